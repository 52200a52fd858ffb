"""rlt-decode's token-level pipeline on CPU: decode steps kept in flight with their tokens read
back ``depth`` steps late (the device is synchronous here; the lagged logic is the same), token-
identical to the oracle, to the base engine and to the synchronous static path in fp32 — greedy
and seeded sampling, fixed depth and adaptive exit with per-request bounds, both KV layouts,
arrivals and aborts mid-decode, stop token ids, stop strings and max_tokens reached in flight,
logprobs — with host syncs per step and the in-flight depth counted; a fault inside a pipelined
step aborts only that step's requests and the engine keeps serving."""

from __future__ import annotations

import random

import pytest
import torch

from rlt.platform import EngineConfig, LLMEngine, SamplingParams
from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.composition import build_engine, plan_composition
from rlt.platform.models.ouro_reference import reference_generate
from rlt.platform.platforms import make_platform

from engine_driver import run_arrivals as run


def prompts(n, seed, lo=3, hi=12):
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def engines(path, depth=2, **kw):
    """(base engine, static path without the pipeline, static path with it)."""
    from rlt.decode.feature import PipelineOptions

    config = EngineConfig(model=str(path), dtype="float32", block_size=4, **kw)
    sync = build_engine(config, enabled={"static_buffers": True, "pipeline": False})
    piped = build_engine(config, enabled={"static_buffers": True, "pipeline": True},
                         options={"pipeline": PipelineOptions(depth=depth)})
    return LLMEngine(config), sync, piped


def same(a, b, *, logprobs=False):
    assert (a is None) == (b is None)
    if a is None:
        return
    assert a.token_ids == b.token_ids and a.exit_depths == b.exit_depths
    assert (a.finish_reason, a.stop_reason, a.text) == (b.finish_reason, b.stop_reason, b.text)
    if logprobs:
        # ids exactly; values to fp32 rounding (a row's batch neighbours change GEMM shapes)
        assert [(x.token_id, [t for t, _ in x.top]) for x in a.logprobs] == \
            [(x.token_id, [t for t, _ in x.top]) for x in b.logprobs]
        flat = [[x.logprob, *(v for _, v in x.top)] for x in a.logprobs]
        assert flat == [pytest.approx([x.logprob, *(v for _, v in x.top)], abs=1e-4) for x in b.logprobs]


def run_alike(first, others, ps, params, arrive_every=0):
    """``first``'s outputs for the requests, after checking that each engine of ``others`` gives the same."""
    got = run(first, ps, params, arrive_every=arrive_every)
    for other in others:
        for a, b in zip(got, run(other, ps, params, arrive_every=arrive_every)):
            same(a, b)
    return got


def oracle(path):
    ck = load_checkpoint(path, dtype=torch.float32)
    return ck.family.build_reference(ck.config, ck.weights)


def pipeline_info(engine):
    return engine.describe()["executor"]["pipeline"]


def test_feature_table_and_describe(tiny_checkpoint):
    from rlt.decode.feature import FEATURES

    _, sync, piped = engines(tiny_checkpoint(seed=1))
    rows = {s.name: s for s in piped.features}
    assert rows["pipeline"].enabled and rows["pipeline"].available
    assert piped.describe()["components"]["step_loop"] == ["pipeline"]
    assert sync.describe()["components"]["step_loop"] == ["base"]
    info = pipeline_info(piped)
    assert info["enabled"] and info["depth"] == 2 and info["steps"] == 0
    assert pipeline_info(sync)["off_reason"] == "pipeline feature off"
    npu = {s.name: s for s in plan_composition(make_platform("npu"), FEATURES).table}
    assert not npu["pipeline"].available and "async_execution" in npu["pipeline"].reason


def test_needs_static_buffers_and_a_valid_depth(tiny_checkpoint):
    from rlt.decode.feature import PipelineOptions
    from rlt.platform.engine.core import SyncStepLoop

    config = EngineConfig(model=str(tiny_checkpoint(seed=1)), dtype="float32")
    engine = build_engine(config, enabled={"static_buffers": False, "graphs": False, "pipeline": True})
    assert type(engine.ctx.parts.step_loop) is SyncStepLoop  # nothing to pipeline: the base loop stays
    with pytest.raises(ValueError, match="pipeline-depth"):
        PipelineOptions(depth=-1)


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("depth", [0, 1, 3])
def test_greedy_equals_oracle_and_sync(tiny_checkpoint, layout, depth):
    path = tiny_checkpoint(seed=1)
    base, sync, piped = engines(path, depth=depth, kv_layout=layout)
    ps = prompts(4, seed=depth, lo=2 if layout == "shared" else 3, hi=7 if layout == "shared" else 12)
    sp = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    got = run_alike(piped, (base, sync), ps, sp, arrive_every=2)
    ref = oracle(path)
    for p, o in zip(ps, got):
        want, depths = reference_generate(ref, p, max_tokens=7, layout=layout)
        assert list(o.token_ids) == want and list(o.exit_depths) == depths
    info = pipeline_info(piped)
    assert info["lagged_steps"] > 0 and info["in_flight_max"] == depth and info["in_flight"] == 0
    # lagged steps read nothing back at launch, and on CPU their copies are complete when read:
    # every host sync is a synchronous step's (its exit mask and tokens)
    assert info["host_syncs"] <= 2 * (info["steps"] - info["lagged_steps"])
    assert pipeline_info(sync)["host_syncs_per_step"] > info["host_syncs_per_step"]


def test_adaptive_exit_bounds_arrivals_and_aborts(tiny_checkpoint):
    path = tiny_checkpoint(seed=6, gate_bias=0.5)
    base, sync, piped = engines(path)
    ps = prompts(6, seed=9)
    params = [SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, exit_threshold=t, min_loops=lo,
                             max_loops=hi) for t, lo, hi in [(0.5, 1, None), (0.7, 2, 4), (1.0, 1, 3), (0.3, 1, 2),
                                                              (0.0, 2, 3), (1.0, 1, None)]]
    kw = dict(arrive_every=3, abort=("r2", 11))
    got = run(piped, ps, params, **kw)
    for a, b, c in zip(got, run(base, ps, params, **kw), run(sync, ps, params, **kw)):
        same(a, b)
        same(a, c)
    assert got[2] is None and len({d for o in got if o for d in o.exit_depths}) > 1
    info = pipeline_info(piped)
    assert info["lagged_steps"] > 0 and info["synchronous_steps"].get("a row may exit on the gate", 0) > 0
    assert not piped.has_unfinished_requests() and piped.stats().num_free_kv_blocks == piped.stats().num_kv_blocks


def test_abort_while_steps_are_in_flight(tiny_checkpoint):
    """Aborting a request whose tokens are still in flight: it finishes at once, its in-flight
    tokens are never emitted, its slot is reused, and the others are untouched."""
    path = tiny_checkpoint(seed=3)
    base, _, piped = engines(path, depth=3, max_num_seqs=2)
    ps = prompts(3, seed=4)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(ps):
        piped.add_request(f"r{i}", p, sp)
    outs = {}
    while not any(r.request.num_pending for r in piped.core.scheduler._rows.values()):
        outs.update({o.request_id: o for o in piped.step() if o.finished})
    aborted = piped.abort_request("r0")
    assert aborted.finished and aborted.finish_reason == "abort"
    assert len(aborted.token_ids) < 12
    while piped.has_unfinished_requests():
        outs.update({o.request_id: o for o in piped.step() if o.finished})
    assert "r0" not in outs  # nothing more reported for it
    want = run(base, ps[1:], sp)
    assert [outs["r1"].token_ids, outs["r2"].token_ids] == [o.token_ids for o in want]
    assert piped.stats().num_free_kv_blocks == piped.stats().num_kv_blocks


def test_seeded_sampling_stops_lengths_and_logprobs(tiny_checkpoint):
    path = tiny_checkpoint(seed=2)
    base, sync, piped = engines(path)
    ps = prompts(7, seed=3)
    first = run(base, ps[:1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    stop_id = first.token_ids[3]
    ps[3], ps[4] = ps[0], "Hello world"
    text = run(base, [ps[4]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].text
    assert len(text) >= 4
    stop_str = text[2:4]
    params = [SamplingParams(max_tokens=5 + i, temperature=0.8, top_p=0.9, seed=100 + i, logprobs=2) for i in range(3)]
    params += [SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop_id]),
               SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=[stop_str]),
               SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
               SamplingParams(max_tokens=6, temperature=1.0, seed=7, min_tokens=4, stop_token_ids=[stop_id])]
    # logit_bias (greedy: forced and banned tokens; sampled) and min_p, in every path alike
    forced = (first.token_ids[0] + 1) % 300
    ps += [ps[0], ps[1], ps[2]]
    params += [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logit_bias={forced: 100}),
               SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={t: -100 for t in first.token_ids}),
               SamplingParams(max_tokens=7, temperature=1.2, seed=9, min_p=0.2, logit_bias={forced: 3.5}, logprobs=1)]
    got = run(piped, ps, params, arrive_every=2)
    for a, b, c in zip(got, run(base, ps, params, arrive_every=2), run(sync, ps, params, arrive_every=2)):
        same(a, b, logprobs=a.logprobs is not None)
        same(a, c, logprobs=a.logprobs is not None)
    assert got[3].finish_reason == "stop" and got[3].stop_reason == stop_id  # stopped by a token read late
    assert got[4].finish_reason == "stop" and got[4].stop_reason == stop_str
    assert [o.finish_reason for o in got[:3]] == ["length"] * 3 and len(got[5].token_ids) == 1
    assert got[7].token_ids == (forced,) * 5 and not set(got[8].token_ids) & set(first.token_ids)
    # the stopped requests had rows launched past their stop; none of those tokens was emitted
    assert len(got[3].token_ids) == first.token_ids.index(stop_id) + 1


def test_fault_in_a_pipelined_step_aborts_only_that_step(tiny_checkpoint):
    path = tiny_checkpoint(seed=5)
    base, _, piped = engines(path, max_num_seqs=2)
    model = piped.ctx.model
    coda = model.coda
    calls = {"n": 0}

    def failing(h):
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("injected device fault")
        return coda(h)

    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ps = prompts(4, seed=8)
    model.coda = failing
    try:
        outs = run(piped, ps[:2], sp)
    finally:
        model.coda = coda
    errors = [o for o in outs if o.error]
    assert errors and all("injected device fault" in o.error and o.finish_reason == "abort" for o in errors)
    want = run(base, ps[:2], sp)
    for o, w in zip(outs, want):
        assert o.token_ids == w.token_ids[: len(o.token_ids)]  # what was emitted before the fault is right
        if not o.error:
            assert o.token_ids == w.token_ids
    assert piped.stats().num_faults == 1
    # the engine keeps serving, exactly
    assert [o.token_ids for o in run(piped, ps[2:], sp)] == [o.token_ids for o in run(base, ps[2:], sp)]
    assert piped.stats().num_free_kv_blocks == piped.stats().num_kv_blocks


@pytest.mark.parametrize("depth", [1, 3])
def test_penalties_count_tokens_still_in_flight(tiny_checkpoint, depth):
    """Repetition / frequency / presence penalties read a token history the device keeps: lagged steps
    sample from it before the host has read the tokens that fill it. Greedy penalised requests equal
    the oracle's penalised generation, beside unpenalised ones, in every path."""
    path = tiny_checkpoint(seed=2)
    base, sync, piped = engines(path, depth=depth, max_num_seqs=3)
    ps = prompts(5, seed=8)
    settings = [(0.0, 1.25, 1.0), (0.0, 0.0, 2.0), (0.0, 0.0, 1.0), (1.5, 0.5, 1.5), (-0.5, 0.0, 0.5)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, presence_penalty=p, frequency_penalty=f,
                             repetition_penalty=r) for p, f, r in settings]
    # and seeded sampled ones, the same tokens in every path
    ps += prompts(2, seed=9)
    params += [SamplingParams(max_tokens=12, temperature=0.9, seed=5 + i, ignore_eos=True, frequency_penalty=1.5,
                              repetition_penalty=1.3) for i in range(2)]
    got = run_alike(piped, (base, sync), ps, params, arrive_every=2)
    ref = oracle(path)
    for p, o, s in zip(ps, got, settings):
        assert list(o.token_ids) == reference_generate(ref, p, max_tokens=12, penalties=s)[0], s
    assert pipeline_info(piped)["lagged_steps"] > 0
