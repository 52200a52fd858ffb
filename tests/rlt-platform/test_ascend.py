"""Ascend dispatch, exercised on CPU against a fake ``torch_npu`` (same math, recorded calls)."""

from __future__ import annotations

import attrs
import torch

from rlt.attention import KVCache, KVLayout
from rlt.attention.backends.ascend_eager import AscendEagerBackend, npu_scatter_nd
from rlt.platform import EngineConfig, LLMEngine, SamplingParams
from rlt.platform.attention_select import build_attention, select_attention
from rlt.platform.models.ouro_reference import reference_generate
from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.platforms import detect_platform


def _cpu_npu(fake):
    """The NPU platform value with tensors kept on CPU: what the fake device module can run."""
    return attrs.evolve(detect_platform("npu"), device_type="cpu")


def test_npu_auto_selects_ascend_eager_with_scatter_nd(fake_torch_npu):
    p = detect_platform("npu")
    sel = select_attention(p, "auto", dtype=torch.bfloat16, head_dim=128, block_size=128)
    assert sel.name == "ascend_eager"
    backend = build_attention(p, sel)
    kv = KVCache.allocate(num_layers=1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=2, num_planes=1,
                          layout=KVLayout.SHARED, dtype=torch.float32, device="cpu")
    kv.write(0, torch.ones(2, 1, 2), torch.full((2, 1, 2), 2.0), torch.tensor([1, 6]), backend._scatter)
    assert fake_torch_npu.calls.count("npu_scatter_nd_update_") == 2
    assert kv.k[0].view(-1, 2)[[1, 6]].eq(1).all() and kv.v[0].view(-1, 2)[[1, 6]].eq(2).all()
    assert kv.k[0].view(-1, 2)[0].eq(0).all()


def test_portable_update_when_scatter_nd_missing(fake_torch_npu):
    del fake_torch_npu.npu_scatter_nd_update_
    backend = build_attention(detect_platform("npu"), select_attention(
        detect_platform("npu"), "auto", dtype=torch.float32, head_dim=8, block_size=4))
    assert isinstance(backend, AscendEagerBackend)
    kv = KVCache.allocate(num_layers=1, num_blocks=1, block_size=4, num_kv_heads=1, head_dim=2, num_planes=1,
                          layout=KVLayout.SHARED, dtype=torch.float32, device="cpu")
    kv.write(0, torch.ones(1, 1, 2), torch.ones(1, 1, 2), torch.tensor([3]), backend._scatter)
    assert kv.k[0].view(-1, 2)[3].eq(1).all()


def test_engine_on_npu_matches_oracle_and_syncs_before_reuse(fake_torch_npu, tiny_checkpoint):
    path = tiny_checkpoint(seed=31)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4), platform=_cpu_npu(fake_torch_npu))
    assert engine.selection.name == "ascend_eager" and "set_device" in fake_torch_npu.calls
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        before = fake_torch_npu.calls.count("synchronize")
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
                assert fake_torch_npu.calls.count("synchronize") > before  # synced before pages were freed
    assert "npu_scatter_nd_update_" in fake_torch_npu.calls
    ck = load_checkpoint(path, dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    for i, p in enumerate(prompts):
        assert list(done[f"r{i}"].token_ids) == reference_generate(ref, p, max_tokens=5)[0]


def test_npu_scatter_adapter_shapes(fake_torch_npu):
    scatter = npu_scatter_nd(fake_torch_npu)
    dst = torch.zeros(5, 3)
    scatter(dst, torch.tensor([4, 0]), torch.ones(2, 3))
    assert dst[4].eq(1).all() and dst[0].eq(1).all() and dst[1:4].eq(0).all()
