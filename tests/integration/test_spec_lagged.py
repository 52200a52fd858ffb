"""Overlapped self-speculation read back lagged (rlt-spec chains in rlt-decode's pipeline): the host
launches step N+1 before it reads step N's drafts and verdicts — each new chain row embeds the
previous row's draft from the device token table, each check judges the draft at its own entry,
and a rejection is learnt up to ``depth`` steps late (the rows launched meanwhile come back
invalid: no token). fp32 greedy output is token-identical to plain decoding at every pipeline
depth, with rejections (random weights) and long accepted chains (a controlled checkpoint),
requests arriving mid-decode (eager prompt steps between lagged chain steps), and every way a
request can end mid-chain (EOS, stop token ids, stop strings, max_tokens; min_tokens holding stops
off)."""

from __future__ import annotations

import importlib
import importlib.util
import random

import pytest

from rlt.decode.feature import FEATURES as DECODE, PipelineOptions
from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.composition import build_engine
from rlt.spec.bench_checkpoint import scale_loop_updates
from rlt.spec.feature import SpecOptions, features as spec_features
from rlt.spec.stats import SpecStats

from compose_helpers import run_with_arrivals


def _engine(path, depth: int | None, spec: bool = True, chain_lag: int | None = None, **cfg):
    """With self_spec (overlapped chains) and rlt-decode (pipeline at ``depth``; None: plain engine
    without speculation or rlt-decode, the reference); chains read back ``chain_lag`` steps late
    (None: the pipeline's depth)."""
    config = EngineConfig(model=str(path), dtype="float32", block_size=4, **{"max_num_seqs": 4, **cfg})
    if depth is None:
        return build_engine(config, features=spec_features() + DECODE,
                            enabled={f.name: False for f in DECODE} | {"self_spec": False})
    return build_engine(config, features=spec_features() + DECODE,
                        enabled={"self_spec": spec, "async_self_spec": spec},
                        options={"self_spec": SpecOptions(adaptive=False, chain_lag=depth if chain_lag is None else chain_lag),
                                 "pipeline": PipelineOptions(depth=depth)})


def _items(seed, n=6, **params):
    rng = random.Random(seed)
    return [([rng.randrange(3, 300) for _ in range(rng.randint(2, 12))],
             SamplingParams(**{"max_tokens": rng.randint(8, 20), "temperature": 0.0, "ignore_eos": True,
                               "speculation": {"num_tokens": 1 + i % 5, "draft_loops": 1 + i % 3}, **params}))
            for i in range(n)]


@pytest.mark.parametrize("depth", [0, 1, 3])
@pytest.mark.parametrize("scale", [1.0, 0.03], ids=["random", "controlled"])
def test_lagged_chains_are_exact_at_every_pipeline_depth(tiny_checkpoint, tmp_path, depth, scale):
    path = scale_loop_updates(tiny_checkpoint(seed=8), tmp_path / "ck", scale)
    items = _items(9)
    want = run_with_arrivals(_engine(path, None), [(p, sp.with_(speculation=None)) for p, sp in items], 3)
    engine = _engine(path, depth)
    lag = engine.ctx.parts.scheduler.lag
    assert lag == depth  # adaptive K's cost model counts the late verdicts
    stats = SpecStats()
    engine.add_observer(stats)
    got = run_with_arrivals(engine, items, 3)
    for w, g in zip(want, got):
        assert g.error is None and list(g.token_ids) == list(w.token_ids), g.request_id
        assert list(g.exit_depths) == list(w.exit_depths)
    steps = engine.ctx.parts.executor.describe()["steps"]
    assert steps.get("lagged_with_feature_rows", 0) > 0  # chain steps were read back lagged
    assert stats.rejected > 0  # rejections happened (learnt late at depth > 0)
    if scale != 1.0:
        assert stats.acceptance > 0.5
    kv = engine.stats()
    assert kv.num_free_kv_blocks == kv.num_kv_blocks


def test_open_chains_keep_chain_lag_steps_in_flight(tiny_checkpoint, tmp_path):
    """By default (``chain_lag`` 1) a pipeline of depth 3 keeps at most one step in flight while a chain
    is open — its verdicts are read one step late — and its own depth otherwise; the tokens are plain
    decoding's."""
    from rlt.spec.feature import CHAIN_LAG

    path = scale_loop_updates(tiny_checkpoint(seed=8), tmp_path / "ck", 0.03)
    items = _items(9)
    want = run_with_arrivals(_engine(path, None), [(p, sp.with_(speculation=None)) for p, sp in items], 3)
    config = EngineConfig(model=str(path), dtype="float32", block_size=4, max_num_seqs=4)
    engine = build_engine(config, features=spec_features() + DECODE, enabled={"self_spec": True, "async_self_spec": True},
                          options={"self_spec": SpecOptions(adaptive=False), "pipeline": PipelineOptions(depth=3)})
    scheduler = engine.ctx.parts.scheduler
    assert scheduler.lag == CHAIN_LAG == 1
    open_steps, closed = 0, []
    done, pending, step = {}, list(enumerate(items)), 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:
            i, (prompt, params) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params)
        done.update({o.request_id: o for o in engine.step() if o.finished})
        in_flight = engine.describe()["executor"]["pipeline"]["in_flight"]  # after this step's launch
        if scheduler.chains:
            open_steps += 1
            assert in_flight <= CHAIN_LAG, (step, in_flight)
        else:
            closed.append(in_flight)
        step += 1
    for i, w in enumerate(want):
        g = done[f"r{i}"]
        assert g.error is None and list(g.token_ids) == list(w.token_ids), g.request_id
    assert open_steps > 10 and max(closed, default=0) <= 3


@pytest.mark.parametrize("depth", [1, 3])
def test_lagged_chains_end_like_plain_decoding(tiny_checkpoint, tmp_path, depth):
    """Requests that end mid-chain — on an EOS, a stop token id, a stop string, at max_tokens —
    end exactly where plain decoding ends them, with the same finish reason and text; min_tokens
    suppresses stop tokens until reached."""
    path = scale_loop_updates(tiny_checkpoint(seed=6), tmp_path / "ck", 0.03)
    ref = _engine(path, None)
    base = _items(4, n=4, max_tokens=24)
    first = run_with_arrivals(ref, [(p, sp.with_(speculation=None)) for p, sp in base], 1)
    items = []
    for (p, sp), out in zip(base, first):
        toks = list(out.token_ids)
        items += [
            (p, sp.with_(stop_token_ids=[toks[5]])),  # a stop token id mid-way
            (p, sp.with_(stop_token_ids=[toks[5]], min_tokens=8)),  # ... suppressed until 8 tokens
            (p, sp.with_(ignore_eos=False)),  # EOS (the tiny vocabulary's) if it comes
            (p, sp.with_(max_tokens=7)),
            (p, sp.with_(stop=[out.text[len(out.text) // 2:][:3]] if len(out.text) > 8 else None)),
        ]
    want = run_with_arrivals(ref, [(p, sp.with_(speculation=None)) for p, sp in items], 2)
    got = run_with_arrivals(_engine(path, depth, max_num_seqs=6), items, 2)
    for w, g in zip(want, got):
        assert g.error is None
        assert (list(g.token_ids), g.finish_reason, g.text) == (list(w.token_ids), w.finish_reason, w.text), \
            g.request_id
    assert any(w.finish_reason == "stop" for w in want)


def test_logprobs_make_chain_steps_read_at_once(tiny_checkpoint, tmp_path):
    """A request that wants logprobs makes its chain's steps synchronous (its heads are read at
    once): the same tokens and logprobs as plain decoding; other chain steps stay lagged."""
    path = scale_loop_updates(tiny_checkpoint(seed=3), tmp_path / "ck", 0.03)
    items = _items(2, n=3)
    items[1] = (items[1][0], items[1][1].with_(logprobs=2))
    want = run_with_arrivals(_engine(path, None), [(p, sp.with_(speculation=None)) for p, sp in items], 1)
    engine = _engine(path, 2)
    got = run_with_arrivals(engine, items, 1)
    for w, g in zip(want, got):
        assert list(g.token_ids) == list(w.token_ids)
    for a, b in zip(got[1].logprobs, want[1].logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    pipe = engine.ctx.parts.executor.describe()
    assert pipe["steps"].get("lagged_with_feature_rows", 0) > 0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreter)")
@pytest.mark.parametrize("scale", [1.0, 0.03], ids=["random", "controlled"])
def test_fused_greedy_heads_give_plain_decodings_tokens(tiny_checkpoint, tmp_path, monkeypatch, scale):
    """Lagged chain steps whose heads all take the argmax run them in one kernel (rlt.spec.heads; here
    built by Triton's interpreter on CPU tensors): the output is still plain decoding's, token for token,
    with rejections, and the accepted / rejected / step counts are the general path's (the drafts are the
    same); a request with logprobs keeps the general path in the same run."""
    from triton_interpreter import fix_interpreter

    import rlt.spec.executor as spec_executor
    import rlt.spec.heads_kernel as kernel

    fix_interpreter()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    importlib.reload(kernel)
    monkeypatch.delenv("TRITON_INTERPRET")  # the model's own kernels stay off: only the heads' kernel is Triton
    calls = []

    def counted(*args, **kw):
        calls.append(len(kw["checking"]))
        return greedy_heads(*args, **kw)

    greedy_heads = spec_executor.greedy_heads
    path = scale_loop_updates(tiny_checkpoint(seed=8), tmp_path / "ck", scale)
    items = _items(9)
    items[1] = (items[1][0], items[1][1].with_(logprobs=2))  # read at once: the general path
    want = run_with_arrivals(_engine(path, None), [(p, sp.with_(speculation=None)) for p, sp in items], 3)
    judged = []
    try:
        for fused in (False, True):  # the general path's verdicts, then the kernel's
            monkeypatch.setattr(spec_executor, "fused_heads_usable", lambda t, on=fused: on)
            monkeypatch.setattr(spec_executor, "greedy_heads", counted)
            engine = _engine(path, 1)
            stats = SpecStats()
            engine.add_observer(stats)
            got = run_with_arrivals(engine, items, 3)
            for w, g in zip(want, got):
                assert g.error is None and list(g.token_ids) == list(w.token_ids), g.request_id
            judged.append((stats.accepted, stats.rejected, stats.steps))
    finally:
        importlib.reload(kernel)
    assert sum(calls) > 0 and judged[1][1] > 0  # the kernel judged drafts, some rejected
    assert judged[0] == judged[1]  # the same verdicts in the same steps: the drafts are the same


def test_warm_up_runs_speculative_requests(tiny_checkpoint, tmp_path):
    """The engine warm-up also runs speculative requests where the engine takes them (one alone, then two
    together: the speculative steps' shapes and the chains' heads compile before serving); the engine is
    left clean and plain requests still decode like the reference. Without rlt-spec they are skipped."""
    path = scale_loop_updates(tiny_checkpoint(seed=8), tmp_path / "ck", 0.03)
    engine = _engine(path, 1)
    stats = SpecStats()
    engine.add_observer(stats)
    free = engine.stats().num_free_kv_blocks
    report = engine.warm_up(max_concurrency=2, max_prompt_len=20, output_len=6)
    assert not report.refused and not report.cut
    assert report.requests == 2 + 2 + 2 + 3  # alone: 16, 20; arrivals; burst; speculative: 1 + 2
    assert stats.accepted + stats.rejected > 0  # drafts were judged
    assert not engine.has_unfinished_requests() and engine.stats().num_free_kv_blocks == free
    plain = _engine(path, None)
    assert plain.warm_up(max_concurrency=2, max_prompt_len=20, output_len=6).requests == 2 + 2 + 2
    items = _items(4, n=3)
    want = run_with_arrivals(plain, [(p, sp.with_(speculation=None)) for p, sp in items], 2)
    got = run_with_arrivals(engine, items, 2)
    assert [list(g.token_ids) for g in got] == [list(w.token_ids) for w in want]


def test_a_failing_fused_heads_launch_falls_back_to_the_general_path(tiny_checkpoint, tmp_path, monkeypatch, caplog):
    """A fused-heads launch that raises (e.g. a compile failure) writes nothing: that step and every later one
    take the general path, the reason is kept and logged, and the output is plain decoding's."""
    import rlt.spec.executor as spec_executor

    calls = []

    def failing(*args, **kw):
        calls.append(1)
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(spec_executor, "fused_heads_usable", lambda t: True)
    monkeypatch.setattr(spec_executor, "greedy_heads", failing)
    path = scale_loop_updates(tiny_checkpoint(seed=8), tmp_path / "ck", 0.03)
    items = _items(9)
    want = run_with_arrivals(_engine(path, None), [(p, sp.with_(speculation=None)) for p, sp in items], 3)
    engine = _engine(path, 1)
    with caplog.at_level("WARNING", logger="rlt.spec"):
        got = run_with_arrivals(engine, items, 3)
    for w, g in zip(want, got):
        assert g.error is None and list(g.token_ids) == list(w.token_ids), g.request_id
    executor = engine.ctx.parts.executor.inner
    assert calls == [1] and executor.fused_heads_off == "RuntimeError: no kernel here"
    assert "fused greedy heads failed" in caplog.text
