"""rlt-spec (synchronous and overlapped self-speculation) composed with rlt-kvcache's depth-aware
prefix cache and preemption, rlt-prefill's chunked prefill and rlt-decode's static buffers +
pipeline: fp32 greedy output token-identical to the oracle, with prefix hits and preemptions.

Prompts share a prefix, so later requests start at cached pages (also at fewer loops: a prefix
published by a 4-loop request serves a 2-loop one only at the planes it has); speculating and plain
requests arrive while others decode. Rounds and chains grow KV past the prompt through the cache's
KV manager and roll rejected drafts back by frontier; the cache publishes only prompt pages (every
plane written), so nothing a draft wrote is ever shared. After the run the KV manager's audit
(every block free, in limbo or held with the right reference count) must pass.

Preemption (a KV pool too small for every request at once) takes only requests whose round or
chain is not open (``Request.preemption_holds``); a preempted speculating request resumes — by
swap or by recompute — from its recorded tokens and speculates again.
"""

from __future__ import annotations

import random

import pytest
import torch

from compose_helpers import run_with_arrivals

from rlt.decode.feature import FEATURES as DECODE
from rlt.kvcache.feature import FEATURES as KVCACHE
from rlt.kvcache.options import PreemptionOptions, PrefixCacheOptions
from rlt.kvcache.scheduler import KVCacheScheduler
from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.composition import build_engine
from rlt.platform.models.ouro_reference import reference_generate
from rlt.prefill.features import FEATURES as PREFILL, ChunkedPrefillOptions
from rlt.spec.bench_checkpoint import scale_loop_updates
from rlt.spec.feature import SpecOptions, features as spec_features
from rlt.spec.stats import SpecStats

SHARED = [7, 19, 33, 41, 5, 88, 101, 12, 60, 71, 9, 14, 250, 3]


def _engine(path, *, overlap: bool, decode: bool, preemption: str | None = None, **cfg):
    enabled = {"self_spec": True, "async_self_spec": overlap, "prefix_cache": True, "preemption": bool(preemption),
               "chunked_prefill": True, "packed_prefill": False, "prefill_uva": False}
    if not decode:
        enabled.update({f.name: False for f in DECODE})
    options = {"self_spec": SpecOptions(adaptive=False), "prefix_cache": PrefixCacheOptions(),
               "chunked_prefill": ChunkedPrefillOptions(chunk_size=8)}
    if preemption:
        options["preemption"] = PreemptionOptions(mode=preemption, watermark=0.0)
    cfg = EngineConfig(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=32,
                       **{"max_num_seqs": 4, **cfg})
    return build_engine(cfg, features=spec_features() + KVCACHE + PREFILL + DECODE, enabled=enabled, options=options)


def _check(path, items, outs) -> None:
    ck = load_checkpoint(path, dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    for (prompt, sp), out in zip(items, outs):
        assert out.error is None, out.error
        want, _ = reference_generate(ref, prompt, max_tokens=sp.max_tokens, max_loops=sp.max_loops)
        assert list(out.token_ids) == want, (prompt, sp.speculation)


def _items(seed):
    rng = random.Random(seed)
    specs = [{"num_tokens": 3, "draft_loops": 2}, None, {"num_tokens": 6, "draft_loops": 1},
             {"num_tokens": 2, "draft_loops": 3}, None, {"num_tokens": 4, "draft_loops": 2}]
    out = []
    for i, s in enumerate(specs):
        tail = [rng.randrange(3, 320) for _ in range(rng.randint(1, 9))]
        loops = 2 if i == 4 else None  # the shared prefix through fewer loops (plain: d < depth needed)
        out.append((SHARED + tail, SamplingParams(max_tokens=rng.randint(8, 16), temperature=0.0, ignore_eos=True,
                                                  max_loops=loops, speculation=s)))
    return out


@pytest.mark.parametrize("decode", [False, True], ids=["eager", "static+pipeline"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_speculation_with_prefix_hits_is_exact(tiny_checkpoint, tmp_path, overlap, decode):
    path = scale_loop_updates(tiny_checkpoint(seed=11), tmp_path / "ck", 0.03)  # drafts often accepted
    engine = _engine(path, overlap=overlap, decode=decode)
    comps = engine.assembly.describe()
    assert "prefix_cache" in comps["kv_manager"] and "self_spec" in comps["scheduler"]
    stats = SpecStats()
    engine.add_observer(stats)
    items = _items(seed=2 * overlap + decode)
    outs = run_with_arrivals(engine, items, 3)
    _check(path, items, outs)
    metrics = {m.name: m.value for m in engine.stats().feature_metrics}
    assert metrics["prefix_cache_hit_tokens"] > 0  # later requests started at cached pages
    assert stats.accepted > 0 and stats.rejected > 0  # rounds both kept and rolled back drafts
    engine.ctx.parts.kv_manager.audit()


@pytest.mark.parametrize("decode", [False, True], ids=["eager", "static+pipeline"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_speculation_with_preemption_is_exact(tiny_checkpoint, tmp_path, overlap, decode, mode):
    path = scale_loop_updates(tiny_checkpoint(seed=11), tmp_path / "ck", 0.03)
    # 6 requests of up to 23 + 16 positions (10 pages x 4 planes each) in 40 blocks: preemption
    engine = _engine(path, overlap=overlap, decode=decode, preemption=mode, num_kv_blocks=40, max_num_seqs=5)
    policy = engine.ctx.parts.scheduler
    while not isinstance(policy, KVCacheScheduler):  # the rlt-kvcache policy under the wrappers
        policy = policy.inner
    victims = []
    preempt = policy._preempt

    def watch(victim):
        victims.append((victim.request_id, bool(victim.params.speculation), set(victim.preemption_holds)))
        preempt(victim)

    policy._preempt = watch
    stats = SpecStats()
    engine.add_observer(stats)
    items = _items(seed=5 + overlap)
    outs = run_with_arrivals(engine, items, 2)
    _check(path, items, outs)
    assert any(spec for _, spec, _ in victims), victims  # speculating requests were preempted and resumed
    assert all(not holds for _, _, holds in victims)  # never one with an open round or chain
    assert stats.accepted > 0 and stats.rejected > 0
    engine.ctx.parts.kv_manager.audit()
