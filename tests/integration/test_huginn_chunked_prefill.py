"""Huginn-0125 with rlt-prefill's chunked prefill (the one rlt-prefill feature its composition allows
besides prefill_uva): prompts cut into chunks — sequential and wavefront, chunks down to one token,
budgets below the prompt — give the eager reference's fp32 greedy tokens at mixed recurrence counts,
with requests arriving while others decode."""

from __future__ import annotations

import random

import pytest
import torch

from engine_driver import run_arrivals
from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.checkpoint.loader import load_checkpoint
from rlt.platform.composition import build_engine
from rlt.platform.models.huginn_reference import huginn_reference_generate
from rlt.prefill.features import FEATURES as PREFILL, ChunkedPrefillOptions


class _PromptRows:
    """Step observer: the (start, length) of every prompt row the engine ran."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int]] = []

    def on_step(self, batch, result) -> None:
        self.rows += [(r.start, r.length) for r in batch.rows if r.in_prompt]


@pytest.mark.parametrize("chunk,budget,wavefront", [(3, 8, False), (1, 4, False), (4, 16, True), (0, 6, False)])
def test_huginn_chunked_prefill_matches_the_reference(tiny_checkpoint, chunk, budget, wavefront):
    path = tiny_checkpoint(family="huginn_raven", seed=3)
    cfg = EngineConfig(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=budget,
                       init_state_scale=0.0, num_loops=6, max_num_seqs=3)
    engine = build_engine(cfg, features=PREFILL,
                          enabled={"chunked_prefill": True, "packed_prefill": False, "prefill_uva": False},
                          options={"chunked_prefill": ChunkedPrefillOptions(chunk_size=chunk, wavefront=wavefront)})
    assert {s.name: s.enabled for s in engine.features}["chunked_prefill"]
    seen = _PromptRows()
    engine.add_observer(seen)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(5, 21))] for _ in range(5)]
    counts = [1, 2, 3, 5, 2]
    params = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, max_loops=r) for r in counts]
    outs = run_arrivals(engine, prompts, params, 1)
    ck = load_checkpoint(path, dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    for p, r, o in zip(prompts, counts, outs):
        assert o.error is None, o.error
        assert list(o.token_ids) == huginn_reference_generate(ref, p, max_tokens=5, num_steps=r), (p, r)
    assert max(len(p) for p in prompts) > budget  # a prompt longer than a step: it ran in chunks
    assert any(start > 0 for start, _ in seen.rows) and max(n for _, n in seen.rows) <= (chunk or budget)
