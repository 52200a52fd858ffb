"""The built-in demo models: tiny random checkpoints of each family, generated locally on first use.

They need no download; their weights are random, so their text is noise — they exist to show the
engine, the CLI and the server working end to end. The default (``--model`` omitted) is the Ouro
demo, in ``$RLT_DEMO_DIR`` or ``~/.cache/rlt/demo-ouro-tiny-v2``. The other families' demos are
named by :data:`DEMO_NAMES` (``--model demo-nanbeige-tiny-v2``) and live next to it. (v2: their
``config.json`` has no ``auto_map``, so transformers clients load them without a custom-code prompt.)
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from rlt.platform.checkpoint.tiny import write_tiny_checkpoint

DEMO_NAME = "demo-ouro-tiny-v2"
#: family (model_type) -> demo name
DEMO_NAMES = {"ouro": DEMO_NAME, "nanbeige": "demo-nanbeige-tiny-v2", "huginn_raven": "demo-huginn-tiny-v2"}
DEMO_CONFIGS = {
    "ouro": dict(gate_bias=-1.0, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=448, max_position_embeddings=2048, total_ut_steps=4),
    "nanbeige": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=448, max_position_embeddings=2048, num_loops=2),
    "huginn_raven": dict(n_embd=64, n_heads=4, head_dim=16, intermediate_size=128, vocab_size=448,
                         padded_vocab_size=448, block_size=2048, mean_recurrence=4,
                         init_values={"std": (2 / (5 * 64)) ** 0.5, "embed_scale": 8.0}),
}


def demo_model_dir(family: str = "ouro") -> Path:
    """The directory of ``family``'s demo model, written on first use."""
    ouro_root = Path(os.environ.get("RLT_DEMO_DIR") or Path.home() / ".cache" / "rlt" / DEMO_NAME)
    root = ouro_root if family == "ouro" else ouro_root.parent / DEMO_NAMES[family]
    if (root / "config.json").is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=root.parent))
    write_tiny_checkpoint(tmp, family=family, seed=1234, auto_map=False, **DEMO_CONFIGS[family])
    try:
        tmp.rename(root)
    except OSError:  # another process won the race
        pass
    return root


def resolve_model(model: str | None) -> str:
    """A checkpoint directory for ``--model``: None -> the Ouro demo; a demo name -> that demo; else as given."""
    if model is None:
        return str(demo_model_dir())
    by_name = {name: family for family, name in DEMO_NAMES.items()}
    if model in by_name and not Path(model).is_dir():
        return str(demo_model_dir(by_name[model]))
    return model
