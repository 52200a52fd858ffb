"""Controlled-acceptance benchmark checkpoints for self-speculation.

Random weights give drafts no meaningful acceptance: every loop moves the hidden state as much as
the first. :func:`scale_loop_updates` rewrites a checkpoint so each loop moves it less: the
sandwich norms that scale the attention and MLP outputs added to the residual stream
(``input_layernorm_2`` and ``post_attention_layernorm_2`` of every layer, applied in every loop)
are multiplied by ``scale``. As ``scale`` falls, the state after ``d`` loops approaches the state
after ``D`` loops, so a depth-``d`` draft agrees with the full-depth token more often; shapes,
bytes moved and FLOPs are unchanged. The acceptance a scale gives is measured by the benchmark
(``benchmarks/spec_bench.py``), not assumed. :func:`scale_weights` does the same to weights in
memory (the benchmark scales a loaded checkpoint instead of writing one per scale).

Writes files (config, tokenizer files copied; weights rewritten) or returns new weight dicts;
touches no engine.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import load_file, save_file

SCALED = ("input_layernorm_2.weight", "post_attention_layernorm_2.weight")


def _check(scale: float) -> None:
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")


def scale_weights(weights: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A new weight dict: the loop-update norms scaled by ``scale``, every other tensor shared."""
    _check(scale)
    return {name: (w.float() * scale).to(w.dtype) if name.endswith(SCALED) else w for name, w in weights.items()}


def scale_loop_updates(src: str | Path, dst: str | Path, scale: float) -> Path:
    """Copy the checkpoint at ``src`` to ``dst`` with every loop's residual updates scaled."""
    _check(scale)
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors in {src}")
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, dst / f.name)
    for shard in shards:
        save_file(scale_weights(load_file(shard), scale), dst / shard.name, metadata={"format": "pt"})
    return dst
