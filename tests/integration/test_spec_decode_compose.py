"""rlt-spec (synchronous and overlapped self-speculation) composed with rlt-decode's static
buffers and token-level pipeline (graphs where the platform has them) and rlt-prefill's chunked
prefill, at their defaults: fp32 greedy output token-identical to the oracle.

Requests arrive while others decode, so lagged plain decode steps (tokens still on the device)
alternate with speculative steps (eager, synchronous: the pipeline drains before them). Adaptive
K on random weights (a high ``min_gain``) drops requests to plain decoding (their steps lagged) and
probes with rounds that start while their last tokens are still in flight.
"""

from __future__ import annotations

import random

import pytest

from compose_helpers import run_with_arrivals

from rlt.decode.feature import FEATURES as DECODE
from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.composition import build_engine
from rlt.platform.models.ouro_reference import reference_generate
from rlt.prefill.features import FEATURES as PREFILL, ChunkedPrefillOptions
from rlt.spec.bench_checkpoint import scale_loop_updates
from rlt.spec.feature import SpecOptions, features as spec_features
from rlt.spec.stats import SpecStats


def _engine(path, overlap: bool):
    cfg = EngineConfig(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=40, max_num_seqs=6)
    feats = spec_features() + DECODE + PREFILL
    return build_engine(cfg, features=feats, enabled={"self_spec": True, "async_self_spec": overlap},
                        options={"self_spec": SpecOptions(probe_interval=3, min_gain=0.5),
                                 "chunked_prefill": ChunkedPrefillOptions(chunk_size=8)})


def _items(seed):
    rng = random.Random(seed)
    specs = [None, {"num_tokens": 3, "draft_loops": 1}, {"num_tokens": 8, "draft_loops": 2}, None,
             {"num_tokens": 2, "draft_loops": 3}, {"num_tokens": 5, "draft_loops": 2}, {"num_tokens": 1}]
    return [([rng.randrange(3, 320) for _ in range(rng.randint(2, 20))],
             SamplingParams(max_tokens=rng.randint(10, 24), temperature=0.0, ignore_eos=True, speculation=s))
            for s in specs]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("scale", [1.0, 0.03], ids=["random", "controlled"])
def test_speculation_with_decode_pipeline_is_exact(tiny_checkpoint, tmp_path, overlap, scale):
    path = scale_loop_updates(tiny_checkpoint(seed=5), tmp_path / "ck", scale)
    engine = _engine(path, overlap)
    comps = engine.assembly.describe()
    assert comps["executor"] == ["self_spec", "static_buffers"] and comps["step_loop"] == ["pipeline"]
    stats = SpecStats()
    engine.add_observer(stats)
    items = _items(3)
    outs = run_with_arrivals(engine, items, 4)  # arrivals while others decode
    ck = load_checkpoint(path, dtype=__import__("torch").float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    for i, (prompt, sp) in enumerate(items):
        want, depths = reference_generate(ref, prompt, max_tokens=sp.max_tokens)
        out = outs[i]
        assert out.error is None
        assert list(out.token_ids) == want, (i, sp.speculation)
        assert list(out.exit_depths) == depths
    pipe = engine.ctx.parts.executor.describe()["pipeline"]
    assert stats.rounds > 0 and pipe["lagged_steps"] > 0  # both kinds of steps ran
    assert pipe["synchronous_steps"].get("not a decode-only step", 0) > 0
    if scale == 1.0:  # requests fell back to plain (lagged) decoding and probed with tokens in flight
        assert pipe["drains"].get("non-decode step with tokens in flight", 0) > 0
