"""GPU: rlt-kvcache on CUDA with the Triton backend — fp32 greedy token-identical to the oracle
under forced preemption (swap through pinned host memory, and recompute) and prefix-cache hits
(also a burst that computes its shared prefix once); seeded sampling identical with and without preemption; a bf16 swap round trip is bit-exact."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rlt.attention import KVCache, KVLayout
from rlt.kvcache.feature import FEATURES
from rlt.kvcache.options import PreemptionOptions, PrefixCacheOptions
from rlt.kvcache.swap import HostSwapper
from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.composition import build_engine
from rlt.platform.models.ouro_reference import reference_generate

from gpu_helpers import run_prompts as _run

pytestmark = pytest.mark.gpu


def _engine(path, *, preemption=None, prefix=False, **cfg):
    enabled = {"preemption": preemption is not None, "prefix_cache": prefix}
    options = {"preemption": preemption} if preemption is not None else {}
    if prefix:
        options["prefix_cache"] = PrefixCacheOptions()
    config = EngineConfig(model=str(path), dtype="float32", device="cuda", attention_backend="triton", block_size=16,
                          **cfg)
    return build_engine(config, features=FEATURES, enabled=enabled, options=options)


def _run_each(engine, prompts, params) -> list:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[f"r{i}"] for i in range(len(prompts))]


def _metrics(engine):
    return {m.name: m.value for m in engine.stats().feature_metrics}


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_and_prefix_fp32_equal_oracle_on_cuda(tiny_checkpoint, mode):
    torch.backends.cuda.matmul.allow_tf32 = False
    path = tiny_checkpoint(seed=61, head_dim=16, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    rng = random.Random(6)
    system = [rng.randrange(3, 320) for _ in range(32)]
    prompts = [system + [rng.randrange(3, 320) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # 6 requests of <= 41 + 24 positions: 5 pages x 4 planes = 20 blocks each, 40 in the pool
    eng = _engine(path, preemption=PreemptionOptions(mode=mode), prefix=True, num_kv_blocks=40, max_num_seqs=6)
    outs = _run(eng, prompts, sp)
    ck = load_checkpoint(path, dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    for p, o in zip(prompts, outs):
        assert (list(o.token_ids), list(o.exit_depths)) == reference_generate(ref, p, max_tokens=24)
    m = _metrics(eng)
    assert m["kv_preemptions"] > 0 and m["prefix_cache_hit_tokens"] > 0


def test_burst_sharing_a_prefix_computes_it_once_and_hits_equal_oracle_on_cuda(tiny_checkpoint):
    torch.backends.cuda.matmul.allow_tf32 = False
    path = tiny_checkpoint(seed=63, head_dim=16, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    rng = random.Random(8)
    system = [rng.randrange(3, 320) for _ in range(48)]  # 3 pages
    prompts = [system + [rng.randrange(3, 320) for _ in range(rng.randint(1, 9))] for _ in range(8)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eng = _engine(path, prefix=True, max_num_seqs=8)
    outs = _run(eng, prompts, sp)
    ck = load_checkpoint(path, dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    for p, o in zip(prompts, outs):
        assert (list(o.token_ids), list(o.exit_depths)) == reference_generate(ref, p, max_tokens=12)
    m = _metrics(eng)  # r0 computes the system prompt; the 7 others wait for it and hit every page of it
    assert m["prefix_cache_inflight_waits"] == 7 and m["prefix_cache_hit_tokens"] == 7 * 48


def test_seeded_sampling_same_with_and_without_preemption_on_cuda(tiny_checkpoint):
    path = tiny_checkpoint(seed=62)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(3, 30))] for _ in range(6)]
    sps = [SamplingParams(max_tokens=24, temperature=0.8, seed=i, ignore_eos=True) for i in range(6)]
    want = _run_each(_engine(path), prompts, sps)
    eng = _engine(path, preemption=PreemptionOptions(), num_kv_blocks=36, max_num_seqs=6)
    got = _run_each(eng, prompts, sps)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert _metrics(eng)["kv_preemptions"] > 0


def test_bf16_swap_round_trip_through_pinned_memory():
    cache = KVCache.allocate(num_layers=24, num_blocks=64, block_size=16, num_kv_heads=16, head_dim=128, num_planes=4,
                             layout=KVLayout.LAST_EXITED, dtype=torch.bfloat16, device="cuda")
    cache.k.normal_()
    cache.v.normal_()
    cache.token_depth.random_(0, 4)
    src = np.arange(12).reshape(4, 3)
    dst = np.arange(40, 52).reshape(4, 3)
    sw = HostSwapper(cache)
    saved = sw.save(src)
    assert saved.k.is_pinned()
    sw.restore(dst, saved)
    torch.cuda.synchronize()
    s, d = torch.from_numpy(src.reshape(-1)).cuda(), torch.from_numpy(dst.reshape(-1)).cuda()
    assert torch.equal(cache.k[:, d], cache.k[:, s]) and torch.equal(cache.v[:, d], cache.v[:, s])
    assert torch.equal(cache.token_depth[d[:3]], cache.token_depth[s[:3]])
