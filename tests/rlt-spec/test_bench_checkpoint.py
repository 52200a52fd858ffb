"""The controlled-acceptance benchmark checkpoint: as the scale falls, the state after d loops
approaches the state after D loops — with the end-of-loop norm made constant. (With its random
per-channel weight, every loop multiplied the state by it once more, and the depth-2 and depth-4
states stayed apart at any scale: acceptance plateaued near 0.75 on CPU and on the H200.)"""

from __future__ import annotations

import random

import torch

from rlt.platform.checkpoint import load_checkpoint
from rlt.spec.bench_checkpoint import LOOP_NORM, SCALED, scale_weights


def _gap(ck, weights, tokens) -> float:
    """Largest |depth-2 state - depth-4 state| of the reference model, relative to the state."""
    ref = ck.family.build_reference(ck.config, weights)
    states = ref.forward_last_exited(tokens, [4] * len(tokens), 4)
    return float((states[1] - states[3]).abs().max() / states[3].abs().max())


def test_small_scales_make_shallow_states_match_full_depth(tiny_checkpoint):
    ck = load_checkpoint(tiny_checkpoint(seed=3), dtype=torch.float32)
    tokens = [random.Random(4).randrange(3, 320) for _ in range(12)]
    gaps = [_gap(ck, scale_weights(ck.weights, s), tokens) for s in (1.0, 1e-2, 1e-4, 1e-6)]
    assert gaps[0] > 0.1  # unscaled: later loops move the state
    assert gaps[1] > gaps[2] > gaps[3] and gaps[3] < 1e-4, gaps  # falls with the scale, towards 0
    # the plateau the constant end-of-loop norm removes: scale the updates only
    updates_only = {n: (w * 1e-6 if n.endswith(SCALED) else w) for n, w in ck.weights.items()}
    assert _gap(ck, updates_only, tokens) > 100 * gaps[3]


def test_only_the_named_tensors_change():
    w = {"model.layers.0.input_layernorm_2.weight": torch.full((4,), 2.0),
         "model.layers.0.input_layernorm.weight": torch.tensor([1.0, 2.0, 3.0, 4.0]),
         LOOP_NORM: torch.tensor([0.5, 1.5, 1.0, 1.0])}
    out = scale_weights(w, 0.5)
    assert torch.equal(out["model.layers.0.input_layernorm_2.weight"], torch.full((4,), 1.0))
    assert out["model.layers.0.input_layernorm.weight"] is w["model.layers.0.input_layernorm.weight"]
    assert torch.equal(out[LOOP_NORM], torch.full((4,), 1.0))
