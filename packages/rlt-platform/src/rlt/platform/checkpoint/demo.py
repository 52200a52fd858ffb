"""The built-in demo model: a tiny random Ouro checkpoint generated locally on first use.

It needs no download; its weights are random, so its text is noise — it exists to show the
engine, the CLI and the server working end to end. The directory is ``$RLT_DEMO_DIR`` or
``~/.cache/rlt/demo-ouro-tiny-v2`` (v2: its ``config.json`` has no ``auto_map``, so transformers
clients load it without a custom-code prompt).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from rlt.platform.checkpoint.tiny import write_tiny_checkpoint

DEMO_NAME = "demo-ouro-tiny-v2"
DEMO_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=448, max_position_embeddings=2048,
                   total_ut_steps=4)


def demo_model_dir() -> Path:
    root = Path(os.environ.get("RLT_DEMO_DIR") or Path.home() / ".cache" / "rlt" / DEMO_NAME)
    if (root / "config.json").is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=root.parent))
    write_tiny_checkpoint(tmp, seed=1234, gate_bias=-1.0, auto_map=False, **DEMO_CONFIG)
    try:
        tmp.rename(root)
    except OSError:  # another process won the race
        pass
    return root
