"""rlt-kvcache (prefix cache, preemption) composed with rlt-prefill's chunked / wavefront prefill and
rlt-decode's static buffers: fp32 greedy output token-identical to the oracle.

Preemption is forced by a tiny KV pool; prompts share a prefix (cache hits, also across
``max_loops``); requests arrive while others decode, so chunks and decode rows share steps and
victims stop mid-chunked-prefill and mid-decode and resume in other slots.
"""

from __future__ import annotations

import random

import pytest
import torch

from compose_helpers import run_with_arrivals

from rlt.decode.feature import FEATURES as DECODE
from rlt.kvcache.feature import FEATURES as KVCACHE
from rlt.kvcache.options import PreemptionOptions, PrefixCacheOptions
from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.composition import build_engine
from rlt.platform.models.ouro_reference import reference_generate
from rlt.prefill.features import FEATURES as PREFILL, ChunkedPrefillOptions

SHARED = [7, 19, 33, 41, 5, 88, 101, 12, 60, 71, 9, 14]


def _engine(path, *, chunk, wavefront, mode, static=False, num_blocks=None, budget=24, seqs=4):
    enabled = {"chunked_prefill": True, "packed_prefill": False, "prefill_uva": False, "prefix_cache": True,
               "preemption": mode is not None, "static_buffers": static, "graphs": False}
    options = {"chunked_prefill": ChunkedPrefillOptions(chunk_size=chunk, wavefront=wavefront),
               "prefix_cache": PrefixCacheOptions()}
    if mode is not None:
        options["preemption"] = PreemptionOptions(mode=mode, watermark=0.0)
    cfg = EngineConfig(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=budget,
                       max_num_seqs=seqs, num_kv_blocks=num_blocks)
    enabled = {k: v for k, v in enabled.items() if any(f.name == k for f in KVCACHE + PREFILL + DECODE)}
    return build_engine(cfg, features=KVCACHE + PREFILL + DECODE, enabled=enabled, options=options)


def _items(seed):
    rng = random.Random(seed)
    out = []
    for i in range(7):
        tail = [rng.randrange(3, 320) for _ in range(rng.randint(1, 20))]
        prompt = SHARED + tail if i % 2 == 0 else tail + SHARED
        loops = 2 if i % 3 == 1 else None  # the same prefix through fewer loops: never shares deeper planes
        out.append((prompt, SamplingParams(max_tokens=rng.randint(4, 14), temperature=0.0, ignore_eos=True,
                                           max_loops=loops, priority=i % 2)))
    return out


def _check(path, items, outs):
    ck = load_checkpoint(path, dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    for (p, sp), o in zip(items, outs):
        assert o.error is None, o.error
        want, depths = reference_generate(ref, p, max_tokens=sp.max_tokens, max_loops=sp.max_loops, exit_threshold=1.0)
        assert list(o.token_ids) == want, f"prompt {p}"
        assert list(o.exit_depths) == depths


def _metrics(engine):
    return {m.name: m.value for m in engine.stats().feature_metrics}


@pytest.mark.parametrize("chunk,wavefront", [(3, False), (3, True), (16, False), (16, True)])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_chunked_prefill_prefix_cache_preemption_oracle(tiny_checkpoint, chunk, wavefront, mode):
    path = tiny_checkpoint(seed=31)
    engine = _engine(path, chunk=chunk, wavefront=wavefront, mode=mode, num_blocks=52)
    assert engine.assembly.describe()["scheduler"] == ["preemption", "chunked_prefill"]
    items = _items(seed=chunk * 2 + wavefront)
    outs = run_with_arrivals(engine, items, 3)
    _check(path, items, outs)
    m = _metrics(engine)
    assert m["prefix_cache_hit_tokens"] > 0
    assert m["kv_preemptions"] > 0 and m["kv_resumed"] > 0
    assert m["kv_preemptions_" + mode] > 0


def test_prefix_cache_with_chunked_prefill_and_no_preemption(tiny_checkpoint):
    path = tiny_checkpoint(seed=32)
    engine = _engine(path, chunk=5, wavefront=True, mode=None)
    items = _items(seed=3)
    outs = run_with_arrivals(engine, items, 3)
    _check(path, items, outs)
    assert _metrics(engine)["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_static_buffers_on_top_with_incremental_pages(tiny_checkpoint, mode):
    """rlt-decode's static buffers mirror page tables per slot: they change while decoding here."""
    path = tiny_checkpoint(seed=33)
    engine = _engine(path, chunk=3, wavefront=True, mode=mode, static=True, num_blocks=52)
    assert "static_buffers" in engine.assembly.describe()["executor"]
    items = _items(seed=9)
    outs = run_with_arrivals(engine, items, 3)
    _check(path, items, outs)
    assert _metrics(engine)["kv_preemptions"] > 0


@pytest.mark.parametrize("wavefront", [False, True])
def test_a_burst_sharing_a_prefix_computes_it_once_under_chunked_prefill(tiny_checkpoint, wavefront):
    """Chunked prefill admits a request for one budget token, so before in-flight prefixes were waited
    for, every request of a burst computed the shared prompt itself (no hit at all)."""
    path = tiny_checkpoint(seed=34)
    engine = _engine(path, chunk=5, wavefront=wavefront, mode=None, seqs=8, budget=16)
    rng = random.Random(5)
    items = [(SHARED + [rng.randrange(3, 320) for _ in range(rng.randint(1, 4))],
              SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)) for _ in range(6)]
    computed = []  # (request, start, length) of every depth-0 prompt row

    class Watch:
        def on_step(self, batch, result):
            computed.extend((r.request.request_id, r.start, r.length) for r in batch.rows if r.in_prompt and r.depth == 0)

    engine.add_observer(Watch())
    for i, (p, sp) in enumerate(items):
        engine.add_request(f"r{i}", p, sp)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    _check(path, items, [done[f"r{i}"] for i in range(len(items))])
    shared = len(SHARED)  # 3 pages of 4
    assert sum(max(0, min(s + n, shared) - s) for _, s, n in computed) == shared  # once, by r0
    m = _metrics(engine)
    assert m["prefix_cache_hit_tokens"] == 5 * shared and m["prefix_cache_inflight_waits"] == 5
