"""GPU: self-speculation (rlt-spec), synchronous and overlapped rounds, with the Triton backend —
fp32 greedy token-identical to plain decoding for every K in 1..8 and d in 1..3, mixed with plain
requests, in the eager build and composed with rlt-decode (static buffers, CUDA graphs — replayed
for speculative steps too —, pipeline), and with rlt-kvcache's prefix cache and preemption; bf16
greedy agreement on a controlled-acceptance checkpoint reported with the first-token logprob gap of
disagreements."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.composition import build_engine
from rlt.spec.bench_checkpoint import scale_loop_updates
from rlt.spec.feature import SpecOptions, features

pytestmark = pytest.mark.gpu


def _engine(path, spec: bool, dtype: str, overlap: bool = False, decode: bool = False):
    from rlt.decode.feature import FEATURES as DECODE

    cfg = EngineConfig(model=str(path), dtype=dtype, device="cuda", attention_backend="triton", block_size=16)
    feats = features() + (DECODE if decode else [])
    return build_engine(cfg, features=feats, enabled={"self_spec": spec, "async_self_spec": spec and overlap},
                        options={"self_spec": SpecOptions(adaptive=False)} if spec else {})


def _run(engine, reqs):
    plain = not engine.describe()["components"]["scheduler"][1:]  # no feature wraps the scheduler: no speculation
    for rid, p, sp in reqs:
        engine.add_request(rid, p, sp.with_(speculation=None) if plain else sp)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def _reqs(seed, spec_pairs, max_tokens=12, logprobs=None):
    rng = random.Random(seed)
    out = []
    for i, pair in enumerate(spec_pairs):
        spec = None if pair is None else {"num_tokens": pair[0], "draft_loops": pair[1]}
        out.append((f"r{i}", [rng.randrange(3, 320) for _ in range(rng.randint(3, 30))],
                    SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs,
                                   speculation=spec)))
    return out


@pytest.mark.parametrize("decode", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("scale", [1.0, 0.03])
def test_spec_fp32_greedy_exact_on_gpu(tiny_checkpoint, tmp_path, scale, overlap, decode):
    torch.backends.cuda.matmul.allow_tf32 = False
    path = scale_loop_updates(tiny_checkpoint(seed=61), tmp_path / "ck", scale)
    pairs = [p for pair in itertools.product(range(1, 9), range(1, 4)) for p in (pair, None)]
    reqs = _reqs(3, pairs)
    want = _run(_engine(path, False, "float32"), reqs)
    engine = _engine(path, True, "float32", overlap, decode)
    if decode:
        # the speculative executor is the base, wrapped by rlt-decode's static executor (with its graphs)
        assert engine.describe()["components"]["executor"] == ["self_spec", "graphs", "static_buffers"]
    got = _run(engine, reqs)
    for rid, _, _ in reqs:
        assert list(got[rid].token_ids) == list(want[rid].token_ids), rid
    if decode:  # speculative rows ran in static decode steps, which replayed graphs; chains lagged
        steps = engine.ctx.parts.executor.describe()["steps"]
        assert steps.get("with_feature_rows", 0) > 0 and steps.get("graph_replays", 0) > 0, steps
        assert (steps.get("lagged_with_feature_rows", 0) > 0) == overlap, steps


@pytest.mark.parametrize("decode", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("scale", [1.0, 0.2, 0.03])
def test_wide_chains_fp32_greedy_exact_on_gpu(tiny_checkpoint, tmp_path, scale, decode):
    """Wide chains (four candidates per new position, private KV blocks, the winner promoted on the
    device) through the Triton backend, eagerly and replaying graphs: token-identical to plain
    decoding, with candidates rescuing rejected drafts at scale 0.2."""
    from rlt.decode.feature import FEATURES as DECODE

    torch.backends.cuda.matmul.allow_tf32 = False
    path = scale_loop_updates(tiny_checkpoint(seed=61), tmp_path / "ck", scale)
    reqs = _reqs(5, [(8, 2), None, (4, 2), (8, 3), (2, 2), None])
    want = _run(_engine(path, False, "float32"), reqs)
    cfg = EngineConfig(model=str(path), dtype="float32", device="cuda", attention_backend="triton", block_size=16)
    engine = build_engine(cfg, features=features() + (DECODE if decode else []),
                          enabled={"self_spec": True, "async_self_spec": True},
                          options={"self_spec": SpecOptions(adaptive=False, width=4, wide_lanes=8)})
    seen = []
    engine.add_observer(type("Seen", (), {"on_step": lambda self, b, r: seen.append(
        sum(type(x).__name__ == "CandidateRow" for x in b.rows))})())
    got = _run(engine, reqs)
    for rid, _, _ in reqs:
        assert list(got[rid].token_ids) == list(want[rid].token_ids), rid
    assert sum(seen) > 0
    if decode:
        steps = engine.ctx.parts.executor.describe()["steps"]
        assert steps.get("graph_replays", 0) > 0, steps


@pytest.mark.parametrize("decode", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_spec_bf16_agreement_report(tmp_path, overlap, decode):
    from rlt.platform.checkpoint.tiny import write_tiny_checkpoint

    src = write_tiny_checkpoint(tmp_path / "src", seed=7, hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=4, head_dim=64, torch_dtype="bfloat16")
    path = scale_loop_updates(src, tmp_path / "ck", 0.03)
    reqs = _reqs(4, [(4, 2)] * 32, max_tokens=32, logprobs=0)
    want = _run(_engine(path, False, "bfloat16"), reqs)
    got = _run(_engine(path, True, "bfloat16", overlap, decode), reqs)
    equal, gaps = 0, []
    for rid, _, _ in reqs:
        a, b = list(got[rid].token_ids), list(want[rid].token_ids)
        if a == b:
            equal += 1
            continue
        k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        # the plain run's logprob of its token vs the speculative run's token at the first divergence
        gaps.append((rid, k, float(want[rid].logprobs[k].logprob) - float(got[rid].logprobs[k].logprob)))
    print(f"\nbf16 greedy agreement ({'overlapped' if overlap else 'sync'} spec K=4 d=2, "
          f"{'graphs' if decode else 'eager'}, vs plain): "
          f"{equal}/{len(reqs)}; first divergences "
          f"(request, position, logprob gap): {gaps}")
    assert equal >= len(reqs) // 2, gaps  # bf16 rounding may flip near-ties, not most requests


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_spec_with_prefix_cache_and_preemption_on_gpu(tiny_checkpoint, tmp_path, overlap, mode):
    """rlt-kvcache's prefix cache and preemption (a KV pool too small for every request) with
    speculation and rlt-decode's graphs: fp32 greedy = plain decoding of the base engine; speculating
    requests are preempted between rounds and resume (tests/integration/test_spec_kvcache.py on CPU)."""
    from rlt.decode.feature import FEATURES as DECODE
    from rlt.kvcache.feature import FEATURES as KVCACHE
    from rlt.kvcache.options import PreemptionOptions, PrefixCacheOptions

    torch.backends.cuda.matmul.allow_tf32 = False
    path = scale_loop_updates(tiny_checkpoint(seed=61), tmp_path / "ck", 0.03)
    shared = [7, 19, 33, 41, 5, 88, 101, 12, 60, 71, 9, 14, 250, 3, 17, 99]
    rng = random.Random(4)
    reqs = [(f"r{i}", shared + [rng.randrange(3, 320) for _ in range(rng.randint(1, 9))],
             SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                            speculation=None if i % 3 == 1 else {"num_tokens": 2 + i % 4, "draft_loops": 1 + i % 3}))
            for i in range(8)]
    want = _run(_engine(path, False, "float32"), reqs)
    cfg = EngineConfig(model=str(path), dtype="float32", device="cuda", attention_backend="triton", block_size=4,
                       num_kv_blocks=48, max_num_seqs=6)
    engine = build_engine(cfg, features=features() + DECODE + KVCACHE,
                          enabled={"self_spec": True, "async_self_spec": overlap, "prefix_cache": True,
                                   "preemption": True},
                          options={"self_spec": SpecOptions(adaptive=False), "prefix_cache": PrefixCacheOptions(),
                                   "preemption": PreemptionOptions(mode=mode, watermark=0.0)})
    got = _run(engine, reqs)
    for rid, _, _ in reqs:
        assert list(got[rid].token_ids) == list(want[rid].token_ids), rid
    metrics = {m.name: m.value for m in engine.stats().feature_metrics}
    assert metrics["prefix_cache_hit_tokens"] > 0 and metrics["kv_preemptions"] > 0, metrics
    engine.ctx.parts.kv_manager.audit()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_greedy_heads_equal_the_general_path_on_gpu(tiny_checkpoint, tmp_path, monkeypatch, dtype):
    """Lagged chain steps through rlt-decode's graphs: with the greedy heads in one kernel (rlt.spec.heads,
    RLT_SPEC_FUSED_HEADS=1, the default) the tokens and every verdict are those of the general path (=0), in
    bf16 too (the same LM-head logits, the same first-index argmax); fp32 equals plain decoding; the kernel
    compiled (no fallback to the general path)."""
    import rlt.spec.executor as spec_executor
    from rlt.spec.stats import SpecStats

    torch.backends.cuda.matmul.allow_tf32 = False
    path = scale_loop_updates(tiny_checkpoint(seed=61), tmp_path / "ck", 0.03)
    reqs = _reqs(5, [(k, d) for k in (2, 8) for d in (1, 2, 3)] + [None], max_tokens=24)
    calls = []
    fused = spec_executor.greedy_heads
    monkeypatch.setattr(spec_executor, "greedy_heads", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("RLT_SPEC_FUSED_HEADS", flag)
        engine = _engine(path, True, dtype, overlap=True, decode=True)
        stats = SpecStats()
        engine.add_observer(stats)
        outs = _run(engine, reqs)
        runs[flag] = ({rid: list(o.token_ids) for rid, o in outs.items()}, (stats.accepted, stats.rejected, stats.steps))
        assert bool(calls) == (flag == "1")
        assert engine.ctx.parts.executor.inner.fused_heads_off == ""
    assert runs["1"] == runs["0"] and runs["1"][1][1] > 0  # same tokens and verdicts; some rejections
    if dtype == "float32":
        want = _run(_engine(path, False, dtype), reqs)
        assert runs["1"][0] == {rid: list(o.token_ids) for rid, o in want.items()}
