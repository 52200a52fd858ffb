"""The FlashAttention adapters (FA4 / FA3 / FA2) on CPU, against fake FA modules.

No FlashAttention package runs on CPU, so each fake implements the documented call contract of
its package (paged KV through a per-row page table, KV lengths, varlen queries, bottom-right
causal) in plain PyTorch, independently of rlt's gather code, and records its arguments. That
checks the adapters' plumbing: which page table each row gets (its own depth plane), lengths,
scale, causality, and the LAST_EXITED limitation (exact only for depth-uniform history).

Tolerance: bf16 1e-2 as ||out - ref|| / ||ref|| (the fake computes in fp32; only the output is
rounded to bf16, ~2e-3 measured).
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

from rlt.attention import KVLayout
from rlt.attention.backends.flash import FA2Backend, FA3Backend, FA4Backend, row_plane_page_table, shallower_history
from rlt.attention.backends.torch_ref import TorchReferenceBackend
from rlt.attention.synthetic import random_problem

REF = TorchReferenceBackend()
ROWS = [(37, 5, 2), (5, 1, 0), (64, 17, 3), (20, 20, 1), (9, 1, 3)]


def dense_paged_attention(q, k_cache, v_cache, cu_q, kv_lens, page_table, scale, causal):
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    nh, nkv = q.shape[1], k_cache.shape[2]
    for r in range(len(kv_lens)):
        qs, qe, length = int(cu_q[r]), int(cu_q[r + 1]), int(kv_lens[r])
        pages = page_table[r, : -(-length // bs)].long()
        key = k_cache[pages].reshape(-1, nkv, k_cache.shape[3])[:length].repeat_interleave(nh // nkv, 1).float()
        val = v_cache[pages].reshape(-1, nkv, v_cache.shape[3])[:length].repeat_interleave(nh // nkv, 1).float()
        s = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), key) * scale
        if causal:  # bottom-right: the last query sees every key
            qpos = length - (qe - qs) + torch.arange(qe - qs)
            s = s.masked_fill(torch.arange(length)[None, None, :] > qpos[None, :, None], float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), val).to(q.dtype)
    return out


def dense_varlen_attention(q, k, v, cu_q, cu_k, scale, causal):
    """FlashAttention's dense varlen call: row r's queries over its own keys ``k[cu_k[r]:cu_k[r+1]]``."""
    lens = cu_k[1:] - cu_k[:-1]
    table = torch.arange(k.shape[0], dtype=torch.int32)
    tables = torch.stack([torch.cat([table[int(a):], table[:int(a)]]) for a in cu_k[:-1]])
    return dense_paged_attention(q, k[:, None], v[:, None], cu_q, lens, tables, scale, causal)


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


@pytest.fixture
def calls():
    return []


@pytest.fixture
def fake_fa4(monkeypatch, calls):
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, seqused_k=None, page_table=None, softmax_scale=None,
                               causal=False, **kw):
        if page_table is None:  # dense varlen: k, v [total_k, kv_heads, d]
            calls.append(dict(dense=True, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, causal=causal,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k))
            return dense_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal), None
        assert cu_seqlens_k is None, "page_table excludes cu_seqlens_k"
        assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1
        calls.append(dict(cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, page_table=page_table,
                          softmax_scale=softmax_scale, causal=causal, max_seqlen_q=max_seqlen_q))
        return dense_paged_attention(q, k, v, cu_seqlens_q, seqused_k, page_table, softmax_scale, causal), None

    monkeypatch.setitem(sys.modules, "flash_attn", _module("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", _module("flash_attn.cute",
                                                                 flash_attn_varlen_func=flash_attn_varlen_func))
    return FA4Backend


@pytest.fixture
def fake_fa3(monkeypatch, calls):
    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, page_table=None,
                                cu_seqlens_q=None, max_seqlen_q=None, softmax_scale=None, causal=False, **kw):
        calls.append(dict(cu_seqlens_q=cu_seqlens_q, cache_seqlens=cache_seqlens, causal=causal))
        return dense_paged_attention(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, page_table, softmax_scale,
                                     causal)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                               causal=False, **kw):
        calls.append(dict(dense=True, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, causal=causal))
        return dense_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)

    monkeypatch.setitem(sys.modules, "flash_attn_interface", _module(
        "flash_attn_interface", flash_attn_with_kvcache=flash_attn_with_kvcache,
        flash_attn_varlen_func=flash_attn_varlen_func))
    return FA3Backend


@pytest.fixture
def fake_fa2(monkeypatch, calls):
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, block_table=None, **kw):
        if block_table is None:
            calls.append(dict(dense=True, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, causal=causal))
            return dense_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        assert k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
        lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        calls.append(dict(cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k, causal=causal))
        return dense_paged_attention(q, k, v, cu_seqlens_q, lens, block_table, softmax_scale, causal)

    monkeypatch.setitem(sys.modules, "flash_attn", _module("flash_attn", flash_attn_varlen_func=flash_attn_varlen_func))
    return FA2Backend


def _problem(layout, history="full", block_size=4, seed=0):
    return random_problem(ROWS, num_heads=4, num_kv_heads=2, head_dim=16, block_size=block_size, num_planes=4,
                          layout=layout, dtype=torch.bfloat16, history=history, num_layers=2, layer=1, seed=seed)


def _err(backend, pb):
    got = backend.forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)
    want = REF.forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("fake, block_size", [("fake_fa4", 4), ("fake_fa3", 4), ("fake_fa2", 256)])
@pytest.mark.parametrize("layout", list(KVLayout))
def test_exact_for_shared_and_depth_uniform_history(request, fake, block_size, layout):
    cls = request.getfixturevalue(fake)
    pb = _problem(layout, "full", block_size, seed=block_size)
    assert not bool(shallower_history(pb.kv, pb.meta))
    assert _err(cls(strict=True), pb) < 1e-2


def test_fa4_arguments(fake_fa4, calls):
    pb = _problem(KVLayout.LAST_EXITED)
    FA4Backend().forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)
    (call,) = calls
    assert call["causal"] is True and call["softmax_scale"] == pb.scale
    assert call["cu_seqlens_q"] is pb.meta.query_start_loc and call["seqused_k"] is pb.meta.seq_lens
    assert call["max_seqlen_q"] == pb.meta.max_query_len
    # each row reads its own depth plane
    for r, (_, _, depth) in enumerate(ROWS):
        assert torch.equal(call["page_table"][r], pb.meta.block_tables[r, depth])


def _step_kv(pb):
    """The values a step stored at its new tokens' slots, dense ``[N, kv_heads, d]`` (the model's ``new_kv``)."""
    flat = lambda t: t[pb.layer].reshape(-1, *t.shape[-2:])  # noqa: E731
    return flat(pb.kv.k)[pb.meta.slot_mapping], flat(pb.kv.v)[pb.meta.slot_mapping]


@pytest.mark.parametrize("fake, block_size", [("fake_fa4", 4), ("fake_fa3", 4), ("fake_fa2", 256)])
@pytest.mark.parametrize("layout", list(KVLayout))
def test_fresh_rows_read_the_steps_kv_densely(request, calls, monkeypatch, fake, block_size, layout):
    """Rows starting at position 0 (``meta.fresh``) take the package's dense varlen call over ``new_kv`` with
    ``cu_seqlens_k = cu_seqlens_q``; a step with earlier context, or the switch off, keeps the paged call."""
    cls = request.getfixturevalue(fake)
    fresh = random_problem([(7, 7, 0), (16, 16, 2), (1, 1, 1), (30, 30, 3)], num_heads=4, num_kv_heads=2,
                           head_dim=16, block_size=block_size, num_planes=4, layout=layout, dtype=torch.bfloat16,
                           num_layers=2, layer=1, seed=3)
    assert fresh.meta.fresh and not _problem(layout, block_size=block_size).meta.fresh
    got = cls(dense_fresh=True).forward(fresh.query, fresh.kv, fresh.layer, fresh.meta, fresh.scale,
                                        new_kv=_step_kv(fresh))
    want = REF.forward(fresh.query, fresh.kv, fresh.layer, fresh.meta, fresh.scale)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    (call,) = calls
    assert call["dense"] and call["causal"] and call["cu_seqlens_k"] is fresh.meta.query_start_loc
    assert call["cu_seqlens_q"] is fresh.meta.query_start_loc
    calls.clear()
    stale = _problem(layout, block_size=block_size)
    assert _err(cls(dense_fresh=True), stale) < 1e-2  # earlier context: never dense
    cls(dense_fresh=True).forward(stale.query, stale.kv, stale.layer, stale.meta, stale.scale, new_kv=_step_kv(stale))
    monkeypatch.delenv("RLT_DENSE_PREFILL", raising=False)
    assert cls().takes_new_kv is (cls is FA4Backend)  # on by default where measured (FA4 on the H200)
    monkeypatch.setenv("RLT_DENSE_PREFILL", "0")
    off = cls()
    assert not off.takes_new_kv
    off.forward(fresh.query, fresh.kv, fresh.layer, fresh.meta, fresh.scale)
    assert not any(c.get("dense") for c in calls)
    monkeypatch.setenv("RLT_DENSE_PREFILL", "1")
    assert cls().takes_new_kv


def test_fa2_builds_cumulative_kv_lengths(fake_fa2, calls):
    pb = _problem(KVLayout.SHARED, block_size=256)
    FA2Backend().forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)
    assert calls[0]["cu_seqlens_k"].tolist() == [0, *torch.cumsum(torch.tensor([r[0] for r in ROWS]), 0).tolist()]


def test_page_table_built_once_per_step(fake_fa3, calls):
    pb = _problem(KVLayout.LAST_EXITED)
    backend = FA3Backend()
    backend.forward(pb.query, pb.kv, 0, pb.meta, pb.scale)
    first = backend._table
    backend.forward(pb.query, pb.kv, 1, pb.meta, pb.scale)
    assert backend._table is first
    assert torch.equal(first, row_plane_page_table(pb.kv, pb.meta))


@pytest.mark.parametrize("fake", ["fake_fa4", "fake_fa3"])
def test_last_exited_with_early_exits_is_not_exact(request, fake):
    """The documented limitation: after an early exit FA reads the wrong plane; strict mode says so."""
    cls = request.getfixturevalue(fake)
    pb = _problem(KVLayout.LAST_EXITED, "mixed", seed=9)
    assert bool(shallower_history(pb.kv, pb.meta))
    assert _err(cls(), pb) > 0.05
    with pytest.raises(RuntimeError, match="exited shallower"):
        cls(strict=True).forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)


@pytest.mark.parametrize("cls", [FA4Backend, FA3Backend, FA2Backend])
def test_half_precision_only(cls):
    pb = random_problem([(5, 1, 0)], num_heads=2, num_kv_heads=2, head_dim=16, block_size=4, num_planes=1,
                        layout=KVLayout.SHARED)
    with pytest.raises(ValueError, match="float16/bfloat16"):
        cls().forward(pb.query, pb.kv, 0, pb.meta, pb.scale)


def test_specs_are_honest():
    for cls in (FA4Backend, FA3Backend, FA2Backend):
        assert cls.spec.dtypes == frozenset({torch.float16, torch.bfloat16})
        assert cls.spec.depth_indirection is False and cls.spec.packed_prefill
    assert FA2Backend.spec.block_size_multiple == 256
    assert FA4Backend.spec.graph_safe is False  # not verified under capture
    assert 128 in FA4Backend.spec.head_dims and 256 not in FA4Backend.spec.head_dims


def _package_tree(root, files: dict[str, str]):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("installed,available", [
    # flash-attn-4 alone: a namespace package flash_attn with flash_attn/cute (seen on the H200: FA2 was
    # wrongly reported importable, and its adapter failed on the missing flash_attn_varlen_func)
    ({"flash_attn/cute/__init__.py": "", "cutlass/__init__.py": ""}, {"fa4"}),
    # flash-attn 2 alone: its __init__ must not even run to decide (it imports CUDA kernels)
    ({"flash_attn/__init__.py": "raise RuntimeError('executed')", "flash_attn_2_cuda.py": ""}, {"fa2"}),
    # both, FA4 inside FA2's package directory
    ({"flash_attn/__init__.py": "raise RuntimeError('executed')", "flash_attn_2_cuda.py": "",
      "flash_attn/cute/__init__.py": "", "cutlass/__init__.py": ""}, {"fa4", "fa2"}),
])
def test_flash_availability_tells_the_packages_apart(tmp_path, monkeypatch, installed, available):
    import importlib

    from rlt.attention import BACKENDS

    for name in [m for m in sys.modules if m.split(".")[0] in ("flash_attn", "flash_attn_2_cuda", "cutlass")]:
        monkeypatch.delitem(sys.modules, name)
    _package_tree(tmp_path, installed)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert {n for n in ("fa4", "fa3", "fa2") if BACKENDS[n].is_available()} == available
    assert "flash_attn" not in sys.modules  # decided without executing package code
