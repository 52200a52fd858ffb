"""Controlled-acceptance benchmark checkpoints for self-speculation.

Random weights give drafts no meaningful acceptance: every loop moves the hidden state as much as
the first. :func:`scale_loop_updates` rewrites a checkpoint so each loop moves it less: the
sandwich norms that scale the attention and MLP outputs added to the residual stream
(``input_layernorm_2`` and ``post_attention_layernorm_2`` of every layer, applied in every loop)
are multiplied by ``scale``, and the end-of-loop norm's weight (``model.norm.weight``, applied to
the state at the end of every loop) is replaced by its mean. As ``scale`` falls, the state after
``d`` loops approaches the state after ``D`` loops, so a depth-``d`` draft agrees with the
full-depth token more often; shapes, bytes moved and FLOPs are unchanged. The second change is
needed because a loop that adds (almost) nothing still ends with that norm: with a weight ``w``
that varies across channels, each loop multiplies the state by ``w`` once more, so depth-``d`` and
depth-``D`` states differ by ``w^(D-d)`` whatever the scale (measured: per-draft acceptance at
d = 2 plateaued at 0.70-0.81 on the H200 for scales 0.002 to 0.0001, and at 0.744 on CPU for
1e-4 and 1e-6 alike); a constant weight makes the norm idempotent. The acceptance a scale gives
is measured by the benchmark (``benchmarks/spec_bench.py``), not assumed. :func:`scale_weights`
does the same to weights in memory (the benchmark scales a loaded checkpoint instead of writing one
per scale).

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
#: the end-of-loop norm (every loop ends with it): made constant so a near-empty loop changes nothing
LOOP_NORM = "model.norm.weight"


def _check(scale: float) -> None:
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")


def scale_weights(weights: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A new weight dict: the loop-update norms scaled by ``scale``, the end-of-loop norm constant
    (its mean), every other tensor shared."""
    _check(scale)

    def rewrite(name: str, w: torch.Tensor) -> torch.Tensor:
        if name.endswith(SCALED):
            return (w.float() * scale).to(w.dtype)
        if name == LOOP_NORM:
            return torch.full_like(w, w.float().mean().item())
        return w

    return {name: rewrite(name, w) for name, w in weights.items()}


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
