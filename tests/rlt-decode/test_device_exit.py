"""Device-planned decode steps under adaptive exit (``--pipeline-device-exit``) on CPU: a decode
step where a row may exit on the gate is open (exits and tokens read back with the lag) and the
following steps of the same rows are planned on the device from its exit mask. Token-identical to
the oracle, to the base engine and to the pipeline without it in fp32 — greedy and seeded sampling
(with min_tokens), adaptive exit with per-request bounds mixed with fixed depth, both KV layouts,
pipeline depths 0–3, arrivals and aborts mid-run, stop ids, stop strings and max_tokens, logprobs —
with every way a run ends exercised; a host/device disagreement and a fault inside a device-planned
step are engine faults for that step's requests only, and the engine keeps serving."""

from __future__ import annotations

from attrs import evolve as attrs_evolve
import pytest
import torch

from rlt.platform import EngineConfig, LLMEngine, SamplingParams
from rlt.platform.composition import build_engine
from rlt.platform.models.ouro_reference import reference_generate

from engine_driver import run_arrivals as run
from test_pipeline import oracle, prompts, run_alike, same


def engines(path, depth=2, device_exit=True, **kw):
    """(base engine, pipeline without device-planned steps, pipeline with them)."""
    from rlt.decode.feature import PipelineOptions

    config = EngineConfig(model=str(path), dtype="float32", block_size=4, **kw)
    plain = build_engine(config, enabled={"static_buffers": True, "pipeline": True},
                         options={"pipeline": PipelineOptions(depth=depth)})
    planned = build_engine(config, enabled={"static_buffers": True, "pipeline": True},
                           options={"pipeline": PipelineOptions(depth=depth, device_exit=device_exit)})
    return LLMEngine(config), plain, planned


def device_exit_info(engine):
    return engine.describe()["executor"]["pipeline"]["device_exit"]


ADAPTIVE = [(0.5, 1, None), (0.7, 2, 4), (1.0, 1, 3), (0.3, 1, 2), (0.0, 2, 3), (0.6, 1, None)]


def adaptive_params(max_tokens=9, **kw):
    return [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, exit_threshold=t, min_loops=lo,
                           max_loops=hi, **kw) for t, lo, hi in ADAPTIVE]


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("depth", [0, 1, 3])
def test_greedy_adaptive_equals_oracle_and_the_host_planned_pipeline(tiny_checkpoint, layout, depth):
    path = tiny_checkpoint(seed=6, gate_bias=0.5)
    base, plain, planned = engines(path, depth=depth, kv_layout=layout, max_num_seqs=4)
    ps = prompts(6, seed=9, lo=2 if layout == "shared" else 3, hi=7 if layout == "shared" else 12)
    params = adaptive_params()
    got = run_alike(planned, (base, plain), ps, params, arrive_every=3)
    ref = oracle(path)
    for p, o, (t, lo, hi) in zip(ps, got, ADAPTIVE):
        want, depths = reference_generate(ref, p, max_tokens=9, layout=layout, exit_threshold=t, min_loops=lo,
                                          max_loops=hi)
        assert list(o.token_ids) == want and list(o.exit_depths) == depths
    assert len({d for o in got for d in o.exit_depths}) > 2  # rows really exit at different depths
    info = device_exit_info(planned)
    assert info["enabled"] and info["open_steps"] > 0 and info["device_planned_steps"] > 0
    # runs end on a finish (read at once at depth 0) or, with steps in flight, when max_tokens is near
    assert set(info["ends"]) == ({"a request finished"} if depth == 0 else {"a request may reach max_tokens in flight"})
    pipe = planned.describe()["executor"]["pipeline"]
    assert "a row may exit on the gate" not in pipe["synchronous_steps"]
    assert "a row may exit on the gate" in plain.describe()["executor"]["pipeline"]["synchronous_steps"]
    assert pipe["in_flight"] == 0 and pipe["in_flight_max"] == depth
    assert not planned.has_unfinished_requests()
    assert planned.stats().num_free_kv_blocks == planned.stats().num_kv_blocks


def test_long_runs_without_host_planning(tiny_checkpoint):
    """Requests admitted together and long generations: most steps are planned on the device, and
    the host syncs only when it has to; a request arriving while a slot is free ends a run."""
    path = tiny_checkpoint(seed=6, gate_bias=0.5)
    base, plain, planned = engines(path, depth=2, max_num_seqs=6)
    ps = prompts(6, seed=4)
    params = adaptive_params(max_tokens=24)
    for i in range(5):
        planned.add_request(f"r{i}", ps[i], params[i])
    outs = {}
    while device_exit_info(planned)["device_planned_steps"] < 8:
        outs.update({o.request_id: o for o in planned.step() if o.finished})
    assert not device_exit_info(planned)["ends"]  # a run of device-planned steps, unbroken so far
    planned.add_request("r5", ps[5], params[5])
    while planned.has_unfinished_requests():
        outs.update({o.request_id: o for o in planned.step() if o.finished})
    got = [outs[f"r{i}"] for i in range(6)]
    for a, b in zip(got, run(base, ps, params)):
        same(a, b)
    info = device_exit_info(planned)
    pipe = planned.describe()["executor"]["pipeline"]
    assert info["ends"].get("a request can be admitted") == 1
    # open (10 host-planned, 32 device-planned), lagged (every exit known) and prompt steps: none
    # waits for the gate
    assert info["device_planned_steps"] > 0.4 * pipe["steps"]
    assert pipe["steps"] == info["open_steps"] + pipe["lagged_steps"] + sum(pipe["synchronous_steps"].values())
    assert "a row may exit on the gate" not in pipe["synchronous_steps"]
    # on CPU a read-back never blocks: the only host syncs left are the synchronous steps' reads
    assert pipe["host_syncs"] <= 2 * (pipe["steps"] - pipe["lagged_steps"] - info["open_steps"])
    run(plain, ps, params)
    assert plain.describe()["executor"]["pipeline"]["host_syncs"] > pipe["host_syncs"]


def test_seeded_sampling_min_tokens_stops_and_logprobs(tiny_checkpoint):
    """Seeds and min_tokens use the device's generated counts in device-planned steps: the same
    tokens as the synchronous engine."""
    path = tiny_checkpoint(seed=3, gate_bias=0.5)
    base, plain, planned = engines(path, max_num_seqs=8)
    ps = prompts(7, seed=3)
    ada = dict(exit_threshold=0.6, max_loops=None)
    first = run(base, ps[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **ada))[0]
    stop_id = first.token_ids[5]
    ps[3], ps[4] = ps[0], "The quick brown fox"
    text = run(base, [ps[4]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **ada))[0].text
    assert len(text) >= 8
    stop_str = text[5:7]
    params = [SamplingParams(max_tokens=10 + i, temperature=0.8, top_p=0.9, seed=100 + i, logprobs=2, **ada)
              for i in range(3)]
    params += [SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_id], **ada),
               SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop_str], **ada),
               SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, **ada),
               SamplingParams(max_tokens=12, temperature=1.0, seed=7, min_tokens=8, stop_token_ids=[stop_id], **ada)]
    got = run(planned, ps, params)
    for a, b, c in zip(got, run(base, ps, params), run(plain, ps, params)):
        same(a, b, logprobs=a.logprobs is not None)
        same(a, c, logprobs=a.logprobs is not None)
    assert got[3].finish_reason == "stop" and got[3].stop_reason == stop_id
    assert len(got[3].token_ids) == first.token_ids.index(stop_id) + 1  # nothing past the stop emitted
    assert got[4].finish_reason == "stop" and got[4].stop_reason == stop_str
    assert len(got[6].token_ids) >= 8
    info = device_exit_info(planned)
    assert info["device_planned_steps"] > 0 and "a request finished" in info["ends"]


def test_abort_during_a_run(tiny_checkpoint):
    path = tiny_checkpoint(seed=3, gate_bias=0.5)
    base, _, planned = engines(path, depth=3, max_num_seqs=2)
    ps = prompts(3, seed=4)
    sp = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, exit_threshold=0.5)
    for i, p in enumerate(ps):
        planned.add_request(f"r{i}", p, sp)
    outs = {}
    while device_exit_info(planned)["device_planned_steps"] < 3:
        outs.update({o.request_id: o for o in planned.step() if o.finished})
    aborted = planned.abort_request("r0")
    assert aborted.finished and aborted.finish_reason == "abort" and len(aborted.token_ids) < 14
    while planned.has_unfinished_requests():
        outs.update({o.request_id: o for o in planned.step() if o.finished})
    assert "r0" not in outs
    want = run(base, ps[1:], sp)
    assert [outs["r1"].token_ids, outs["r2"].token_ids] == [o.token_ids for o in want]
    assert planned.stats().num_free_kv_blocks == planned.stats().num_kv_blocks


def test_a_host_device_disagreement_is_a_fault_not_a_wrong_token(tiny_checkpoint, monkeypatch):
    """If the device planned a row differently from the host (here: positions never advance), the
    step's requests are aborted with the error; nothing wrong is emitted; the engine keeps serving."""
    from rlt.decode.batch import StaticDecodeBuffers

    path = tiny_checkpoint(seed=5, gate_bias=0.5)
    base, _, planned = engines(path, max_num_seqs=2)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, exit_threshold=0.5)
    ps = prompts(4, seed=8)
    original = StaticDecodeBuffers.advance

    def stuck(self, bucket, num_rows, exited, block_size, shared):
        original(self, bucket, num_rows, torch.zeros_like(exited), block_size, shared)  # "nobody exited"

    monkeypatch.setattr(StaticDecodeBuffers, "advance", stuck)
    outs = run(planned, ps[:2], sp)
    monkeypatch.setattr(StaticDecodeBuffers, "advance", original)
    errors = [o for o in outs if o.error]
    assert errors and all("disagrees with the host" in o.error and o.finish_reason == "abort" for o in errors)
    want = run(base, ps[:2], sp)
    for o, w in zip(outs, want):
        assert o.token_ids == w.token_ids[: len(o.token_ids)]
    assert [o.token_ids for o in run(planned, ps[2:], sp)] == [o.token_ids for o in run(base, ps[2:], sp)]
    assert planned.stats().num_free_kv_blocks == planned.stats().num_kv_blocks


def test_fault_in_a_device_planned_step(tiny_checkpoint):
    path = tiny_checkpoint(seed=5, gate_bias=0.5)
    base, _, planned = engines(path, max_num_seqs=2)
    executor = planned.ctx.parts.executor
    continue_open = executor.continue_open
    calls = {"n": 0}

    def failing():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device fault")
        return continue_open()

    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, exit_threshold=0.5)
    ps = prompts(4, seed=8)
    executor.continue_open = failing
    try:
        outs = run(planned, ps[:2], sp)
    finally:
        del executor.continue_open
    assert calls["n"] >= 3
    errors = [o for o in outs if o.error]
    assert errors and all("injected device fault" in o.error for o in errors)
    want = run(base, ps[:2], sp)
    for o, w in zip(outs, want):
        assert o.token_ids == w.token_ids[: len(o.token_ids)]
    assert planned.stats().num_faults == 1
    assert [o.token_ids for o in run(planned, ps[2:], sp)] == [o.token_ids for o in run(base, ps[2:], sp)]
    assert planned.stats().num_free_kv_blocks == planned.stats().num_kv_blocks


def test_default_on_a_gpu_off_on_cpu_and_off_reasons(tiny_checkpoint):
    """By default on where the device runs apart from the host (a GPU), off on CPU with its reason; on
    when asked, off when refused. (Off with preemption: the composition test with rlt-kvcache,
    tests/integration/test_device_exit_compose.py.)"""
    import types

    import torch

    from rlt.decode.feature import PipelineOptions, device_exit_off_reason

    path = tiny_checkpoint(seed=1)
    _, plain, planned = engines(path)
    assert PipelineOptions().device_exit is None
    assert device_exit_info(plain) == {"enabled": False, "off_reason": "off by default on CPU (no host/device "
                                       "overlap to win; --pipeline-device-exit turns it on)", "open_steps": 0,
                                       "device_planned_steps": 0, "ends": {}}
    assert device_exit_info(planned)["enabled"]
    _, _, refused = engines(path, device_exit=False)
    assert device_exit_info(refused)["off_reason"] == "--no-pipeline-device-exit"

    sampler = planned.ctx.parts.sampler
    def ctx(device, **options):
        return types.SimpleNamespace(device=torch.device(device), feature_options=options,
                                     parts=types.SimpleNamespace(sampler=sampler))
    assert device_exit_off_reason(ctx("cuda", pipeline=PipelineOptions())) == ""
    assert device_exit_off_reason(ctx("cuda", pipeline=PipelineOptions(device_exit=False))) == "--no-pipeline-device-exit"
    assert device_exit_off_reason(ctx("cpu", pipeline=PipelineOptions(device_exit=True))) == ""
    assert "preemption" in device_exit_off_reason(ctx("cuda", pipeline=PipelineOptions(), preemption=object()))
    assert device_exit_off_reason(ctx("cuda")) == "pipeline feature off"


def test_a_running_request_without_a_row_is_not_starved(tiny_checkpoint):
    """A policy may give a running request no row in a step (a verdict or a prompt chunk is due):
    then a step of the others' rows is open but the run ends at once — the host plans the next
    step — so the request runs again as soon as the policy gives it a row. (Were the run to go on,
    it would wait until some request finished.)"""
    from rlt.decode.feature import FEATURES, PipelineOptions
    from rlt.platform.engine.interfaces import StepPlan, Wrapped
    from rlt.platform.features import Feature

    class Holding(Wrapped):
        """Withholds r1's rows from the plans it makes while ``calls`` (its schedule() calls so far) is
        in ``hold``."""

        hold = range(5, 7)

        def schedule(self):
            plan = self.inner.schedule()
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls in self.hold:
                plan = StepPlan(tuple(r for r in plan.rows if r.request.request_id != "r1"), plan.failed)
            return plan

    holding = Feature(name="holding", package="tests", description="withholds a request's rows",
                      install=lambda builder, options: builder.wrap("scheduler", lambda ctx, inner: Holding(inner)))
    path = tiny_checkpoint(seed=6, gate_bias=0.5)
    config = EngineConfig(model=str(path), dtype="float32", block_size=4, max_num_seqs=4)
    ps = prompts(3, seed=2)
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, exit_threshold=0.6),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=0.6),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, exit_threshold=0.5, min_loops=2)]

    def serve(device_exit):
        engine = build_engine(config, features=FEATURES, extra_features=[holding],
                              options={"pipeline": PipelineOptions(device_exit=device_exit)})
        for i, p in enumerate(ps):
            engine.add_request(f"r{i}", p, params[i])
        done, step = {}, 0
        while engine.has_unfinished_requests():
            done.update({o.request_id: (o, step) for o in engine.step() if o.finished})
            step += 1
        return engine, done

    planned, got = serve(True)
    _, want = serve(False)
    for rid in want:
        same(got[rid][0], want[rid][0])
    assert got["r1"][1] <= want["r1"][1] + 3, (got["r1"][1], want["r1"][1])  # r1 finished when it would have
    info = device_exit_info(planned)
    assert info["ends"].get("a running request is not in the run", 0) > 0 and info["device_planned_steps"] > 0


def test_runs_go_on_while_the_waiting_request_is_blocked_on_kv(tiny_checkpoint):
    """A waiting request that a free slot cannot take (its KV blocks are not there) does not end
    runs: only a finish can free blocks, and a finish ends the run anyway. A new arrival does."""
    path = tiny_checkpoint(seed=6, gate_bias=0.5)
    base, _, planned = engines(path, max_num_seqs=4, num_kv_blocks=60)
    ps = [[5 + i, 9, 13, 200, 31, 7] for i in range(3)]
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, exit_threshold=0.6)  # 28 blocks each
    got = run(planned, ps, sp)
    for a, b in zip(got, run(base, ps, sp)):
        same(a, b)
    info = device_exit_info(planned)
    assert info["device_planned_steps"] > 10
    assert "a request can be admitted" not in info["ends"], info
    assert planned.stats().num_free_kv_blocks == planned.stats().num_kv_blocks


def test_penalties_count_only_the_rows_that_exit(tiny_checkpoint):
    """An open step samples every row; a penalised request's token history counts only the rows that
    exited (the step's exit mask, on the device). Greedy penalised requests under adaptive exit equal
    the oracle's penalised generation and the host-planned pipeline."""
    path = tiny_checkpoint(seed=6, gate_bias=0.5)
    base, plain, planned = engines(path, depth=2, max_num_seqs=4)
    ps = prompts(6, seed=9)
    settings = [(0.0, 1.25, 1.0), (0.0, 0.0, 2.0), (1.5, 0.5, 1.5), (0.0, 0.0, 1.0), (-0.5, 0.0, 0.5), (0.0, 2.0, 1.0)]
    params = [attrs_evolve(sp, presence_penalty=p, frequency_penalty=f, repetition_penalty=r)
              for sp, (p, f, r) in zip(adaptive_params(max_tokens=12), settings)]
    # and seeded sampled ones (device-planned seeds and history alike), the same tokens in every path
    ps += prompts(2, seed=10)
    params += [attrs_evolve(sp, temperature=0.9, seed=5 + i, frequency_penalty=1.5, repetition_penalty=1.3)
               for i, sp in enumerate(adaptive_params(max_tokens=12)[:2])]
    got = run_alike(planned, (base, plain), ps, params, arrive_every=3)
    ref = oracle(path)
    for p, o, (t, lo, hi), s in zip(ps, got, ADAPTIVE, settings):
        want, depths = reference_generate(ref, p, max_tokens=12, exit_threshold=t, min_loops=lo, max_loops=hi,
                                          penalties=s)
        assert list(o.token_ids) == want and list(o.exit_depths) == depths, s
    assert device_exit_info(planned)["device_planned_steps"] > 0
