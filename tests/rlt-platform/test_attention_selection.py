"""The attention selection matrix, on CPU, by faking the platform and which packages import.

Platforms come from ``make_platform`` (CUDA SM90 / SM80, ROCm, NPU, CPU); availability is faked by
patching ``BackendEntry.missing_modules`` so no GPU package is needed. Covers the ``auto`` order,
every skip reason, explicit requests that must raise instead of falling back, and the
LAST_EXITED rule for FlashAttention (it reads one page table per row).
"""

from __future__ import annotations

import pytest
import torch

from rlt.attention import BACKENDS, BackendEntry, KVLayout
from rlt.platform.attention_select import (
    AttentionSelection,
    AttentionSelectionError,
    backend_params,
    build_attention,
    select_attention,
)
from rlt.platform.platforms import make_platform

SM90 = make_platform("cuda", arch="sm90")
SM80 = make_platform("cuda", arch="sm80")
ROCM = make_platform("rocm", arch="gfx942")
NPU = make_platform("npu")
CPU = make_platform("cpu")
FA = ("fa4", "fa3", "fa2")
EVERYTHING = ("triton", *FA)
FIXED_DEPTH = dict(kv_layout=KVLayout.LAST_EXITED, adaptive_exit=False)


@pytest.fixture
def importable(monkeypatch):
    """``importable(*names)``: only these optional backends import (torch/ascend_eager always do)."""

    def set_(*names):
        def missing(self):
            if not self.requires_modules or self.name in names:
                return ()
            return self.requires_modules

        monkeypatch.setattr(BackendEntry, "missing_modules", missing)

    return set_


def pick(platform, requested="auto", *, dtype=torch.bfloat16, head_dim=128, block_size=16, **kw):
    return select_attention(platform, requested, dtype=dtype, head_dim=head_dim, block_size=block_size, **kw)


def skipped(sel) -> dict[str, str]:
    return dict(sel.skipped)


# -- CUDA SM90 -----------------------------------------------------------------------------------
def test_sm90_prefers_fa4_when_exact(importable):
    """FA4 owns prefill steps; Triton, when usable, takes decode-only steps (the pair)."""
    importable(*EVERYTHING)
    assert pick(SM90, kv_layout=KVLayout.SHARED).name == "fa4+triton"
    sel = pick(SM90, **FIXED_DEPTH)
    assert sel.name == "fa4+triton" and sel.skipped == () and "auto" in sel.reason
    assert "triton for decode-only steps" in sel.reason
    importable(*FA)  # no Triton: FA4 alone
    assert pick(SM90, **FIXED_DEPTH).name == "fa4"


def test_sm90_fa_order(importable):
    importable("fa3", "fa2", "triton")
    sel = pick(SM90, kv_layout=KVLayout.SHARED)
    assert sel.name == "fa3+triton" and "not importable" in skipped(sel)["fa4"]
    importable("fa2", "triton")
    sel = pick(SM90, kv_layout=KVLayout.SHARED, block_size=256)
    assert sel.name == "fa2+triton"


def test_sm90_last_exited_with_adaptive_exit_uses_triton(importable):
    importable(*EVERYTHING)
    for kw in (dict(kv_layout=KVLayout.LAST_EXITED, adaptive_exit=True), dict(kv_layout=KVLayout.LAST_EXITED), {}):
        sel = pick(SM90, **kw)
        assert sel.name == "triton", kw
        assert "per-token exit depths" in skipped(sel)["fa4"]
        assert "per-token exit depths" in skipped(sel)["fa3"]


def test_sm90_without_flash_attention(importable):
    importable("triton")
    sel = pick(SM90, **FIXED_DEPTH)
    assert sel.name == "triton"
    assert all("not importable" in skipped(sel)[n] for n in FA)
    importable()
    sel = pick(SM90, **FIXED_DEPTH)
    assert sel.name == "torch" and "not importable" in skipped(sel)["triton"]


def test_sm90_fp32_skips_flash_attention(importable):
    importable(*EVERYTHING)
    sel = pick(SM90, dtype=torch.float32, kv_layout=KVLayout.SHARED)
    assert sel.name == "triton" and "dtype" in skipped(sel)["fa4"]


def test_unsupported_shapes_are_skipped_with_reasons(importable):
    importable(*EVERYTHING)
    sel = pick(SM90, head_dim=80, kv_layout=KVLayout.SHARED)  # FA4: 64/96/128 only
    assert sel.name == "triton"
    assert "head_dim 80" in skipped(sel)["fa4"] and "head_dim 80" in skipped(sel)["fa3"]
    assert "block_size 16 is not a multiple of 256" in skipped(sel)["fa2"]
    assert pick(SM90, head_dim=512).name == "torch"  # beyond every kernel


# -- CUDA SM80 -----------------------------------------------------------------------------------
def test_sm80_has_no_fa4_or_fa3(importable):
    importable(*EVERYTHING)
    sel = pick(SM80, kv_layout=KVLayout.SHARED)
    assert sel.name == "triton"
    assert "needs sm90" in skipped(sel)["fa4"] and "needs sm90" in skipped(sel)["fa3"]
    assert pick(SM80, kv_layout=KVLayout.SHARED, block_size=256).name == "fa2+triton"
    with pytest.raises(AttentionSelectionError, match="needs sm90"):
        pick(SM80, "fa3", kv_layout=KVLayout.SHARED)


# -- ROCm, NPU, CPU --------------------------------------------------------------------------------
def test_rocm_never_uses_flash_attention(importable):
    importable(*EVERYTHING)
    sel = pick(ROCM, kv_layout=KVLayout.SHARED)
    assert sel.name == "triton" and sel.skipped == ()
    for name in (*FA, "fa4+triton"):
        with pytest.raises(AttentionSelectionError, match="NVIDIA GPUs only"):
            pick(ROCM, name, kv_layout=KVLayout.SHARED)
    importable()
    assert pick(ROCM).name == "torch"


def test_npu_and_cpu(importable):
    importable(*EVERYTHING)
    assert pick(NPU).name == "ascend_eager"
    assert pick(CPU).name == "torch"
    for platform in (NPU, CPU):
        with pytest.raises(AttentionSelectionError, match="does not declare Triton"):
            pick(platform, "triton")
    with pytest.raises(AttentionSelectionError, match="NVIDIA-only"):
        pick(CPU, "fa4", kv_layout=KVLayout.SHARED)


# -- explicit requests never fall back -------------------------------------------------------------
def test_explicit_requests(importable):
    importable(*EVERYTHING)
    assert pick(SM90, "triton").name == "triton"
    assert pick(SM90, "fa4", **FIXED_DEPTH).reason == "explicitly requested"
    assert pick(SM90, "fa4+triton", **FIXED_DEPTH).name == "fa4+triton"
    with pytest.raises(AttentionSelectionError, match="fa4: .*per-token exit depths"):
        pick(SM90, "fa4+triton", kv_layout=KVLayout.LAST_EXITED, adaptive_exit=True)
    with pytest.raises(AttentionSelectionError, match="per-token exit depths"):
        pick(SM90, "fa4", kv_layout=KVLayout.LAST_EXITED, adaptive_exit=True)
    with pytest.raises(AttentionSelectionError, match="block_size 16 is not a multiple of 256"):
        pick(SM90, "fa2", kv_layout=KVLayout.SHARED)
    importable("triton")
    with pytest.raises(AttentionSelectionError, match="not importable"):
        pick(SM90, "fa4", kv_layout=KVLayout.SHARED)
    importable(*FA)
    with pytest.raises(AttentionSelectionError, match="triton: not importable"):
        pick(SM90, "fa4+triton", kv_layout=KVLayout.SHARED)
    with pytest.raises(AttentionSelectionError, match="unknown attention backend"):
        pick(SM90, "flashinfer")
    with pytest.raises(AttentionSelectionError, match="unknown attention backend"):
        pick(SM90, "triton+fa4")  # only the listed pairs exist


# -- construction ----------------------------------------------------------------------------------
def test_triton_gets_the_platform_dot_precision():
    assert backend_params("triton", SM90) == {"dot_precision": "tf32"}
    assert backend_params("triton", ROCM) == {"dot_precision": "ieee"}
    backend = build_attention(ROCM, AttentionSelection("triton", "test"))  # constructing imports no Triton
    assert backend.name == "triton" and backend.dot_precision == "ieee"


def test_specs_load_without_gpu_packages():
    """The selector reads every spec; that must not import Triton or FlashAttention."""
    import sys

    before = {m for m in sys.modules if m.split(".")[0] in ("triton", "flash_attn", "flash_attn_interface")}
    for entry in BACKENDS.values():
        entry.spec()
    after = {m for m in sys.modules if m.split(".")[0] in ("triton", "flash_attn", "flash_attn_interface")}
    assert after == before


def test_engine_fixed_depth_lets_flashattention_serve_last_exited(importable, tiny_checkpoint):
    """The engine declares ``adaptive_exit=False`` to the selector exactly when it serves fixed depth."""
    from rlt.platform import EngineConfig, LLMEngine
    from rlt.platform.engine.context import attention_constraints

    path = str(tiny_checkpoint(seed=3))
    seen = []
    for fixed in (False, True):
        config = EngineConfig(model=path, dtype="float32", fixed_depth=fixed, num_kv_blocks=64)
        seen.append(attention_constraints(config))
        engine = LLMEngine(config)  # the engine builds with what it declares
        assert engine.selection == select_attention(CPU, "auto", dtype=torch.float32,
                                                    head_dim=engine.model.shape.head_dim, **seen[-1])
    assert [kw["adaptive_exit"] for kw in seen] == [True, False]
    assert all(kw["kv_layout"] is KVLayout.LAST_EXITED for kw in seen)
    importable(*EVERYTHING)
    assert pick(SM90, **{k: seen[1][k] for k in ("kv_layout", "adaptive_exit")}).name == "fa4+triton"
    assert pick(SM90, **{k: seen[0][k] for k in ("kv_layout", "adaptive_exit")}).name == "triton"


def test_pair_builds_a_prefill_decode_backend(importable):
    from rlt.attention.backends.prefill_decode import PrefillDecodeBackend

    backend = build_attention(SM90, AttentionSelection("fa4+triton", "test"))
    assert isinstance(backend, PrefillDecodeBackend)
    assert (backend.prefill.name, backend.decode.name) == ("fa4", "triton")
    assert backend.decode.dot_precision == "tf32"  # each part gets its platform parameters
    assert backend.spec.dtypes == backend.prefill.spec.dtypes and backend.spec.graph_safe
    assert not backend.spec.depth_indirection
