"""Choosing the attention backend for a platform.

``auto`` order (RFC §3): CUDA prefers FA4, FA3, FA2 (whichever import), then Triton, then Torch;
ROCm considers Triton then Torch and never imports FlashAttention; NPU uses ``ascend_eager``; CPU
uses Torch. A candidate is skipped only when it is unavailable or unsuitable (missing package,
wrong arch, dtype, head size, block size), and the skip reason is recorded. An explicit request
never falls back: it either works or raises :class:`AttentionSelectionError` naming the cause.

LAST_EXITED and FlashAttention: FA kernels read one page table per row, so they cannot apply the
per-token version map (spec ``depth_indirection=False``). They are exact under SHARED, and under
LAST_EXITED only when no request can exit early (fixed depth: every context token reached every
plane a query reads). The caller declares that with ``kv_layout`` and ``adaptive_exit``; when it
does not (``None``), an FA backend is treated as unsuitable for LAST_EXITED rather than risk
silently reading the wrong plane.
"""

from __future__ import annotations

import attrs
import torch

from rlt.attention import BACKENDS, AttentionBackend, KVLayout, UnsuitableBackend, create_backend
from rlt.platform.platforms import Capability, Platform

AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("fa4", "fa3", "fa2", "triton", "torch"),
    "rocm": ("triton", "torch"),
    "npu": ("ascend_eager",),
    "cpu": ("torch",),
}
#: FlashAttention generations by minimum / exact SM arch.
_FA_ARCH = {"fa4": ("sm90", "sm100", "sm103", "sm110", "sm120"), "fa3": ("sm90",), "fa2": None}
ATTENTION_CHOICES = ("auto", *BACKENDS)


class AttentionSelectionError(ValueError):
    pass


@attrs.frozen
class AttentionSelection:
    name: str
    reason: str
    skipped: tuple[tuple[str, str], ...] = ()


def backend_params(name: str, platform: Platform) -> dict:
    """Platform-chosen construction parameters of a backend."""
    if name == "triton":
        return {"dot_precision": platform.triton_dot_precision}
    if name == "ascend_eager" and platform.name == "npu":
        from rlt.attention.backends.ascend_eager import npu_scatter_nd
        import importlib

        torch_npu = importlib.import_module("torch_npu")
        if hasattr(torch_npu, "npu_scatter_nd_update_"):
            return {"scatter": npu_scatter_nd(torch_npu)}
    return {}


def _why_unusable(
    name: str, platform: Platform, dtype: torch.dtype, head_dim: int, block_size: int,
    kv_layout: KVLayout | None = None, adaptive_exit: bool | None = None,
) -> str | None:
    entry = BACKENDS[name]
    if entry.vendor == "nvidia" and platform.name != "cuda":
        return f"{name} is NVIDIA-only (platform is {platform.name})"
    if name == "triton" and not platform.has(Capability.TRITON):
        return f"platform {platform.name} does not declare Triton"
    if name == "ascend_eager" and platform.name not in ("npu", "cpu"):
        return "ascend_eager is the NPU backend"
    missing = entry.missing_modules()
    if missing:
        return f"not importable (missing {', '.join(missing)})"
    archs = _FA_ARCH.get(name)
    if archs is not None and platform.arch not in archs:
        return f"{name} needs {'/'.join(archs)}, device is {platform.arch}"
    spec = entry.spec()
    try:
        spec.check(dtype=dtype, head_dim=head_dim, block_size=block_size)
    except UnsuitableBackend as exc:
        return str(exc)
    if not spec.depth_indirection and kv_layout is not KVLayout.SHARED and adaptive_exit is not False:
        declared = "LAST_EXITED" if kv_layout is KVLayout.LAST_EXITED else "a layout not declared"
        return (f"{name} reads one page table per row and cannot resolve per-token exit depths ({declared}, "
                "adaptive exit not ruled out); use triton, --kv-layout shared, or fixed-depth serving")
    return None


def select_attention(
    platform: Platform, requested: str, *, dtype: torch.dtype, head_dim: int, block_size: int,
    kv_layout: KVLayout | None = None, adaptive_exit: bool | None = None,
) -> AttentionSelection:
    """Pick the backend. ``kv_layout`` / ``adaptive_exit`` (may any request exit before its max
    loops?) let FlashAttention serve LAST_EXITED when that is exact; omitted, FA is not used for it."""
    exits = dict(kv_layout=kv_layout, adaptive_exit=adaptive_exit)
    if requested != "auto":
        if requested not in BACKENDS:
            raise AttentionSelectionError(
                f"unknown attention backend {requested!r}; choose one of {', '.join(ATTENTION_CHOICES)}"
            )
        if BACKENDS[requested].vendor == "nvidia" and platform.name == "rocm":
            raise AttentionSelectionError(
                f"attention backend {requested!r} is FlashAttention, which rlt supports on NVIDIA GPUs only; "
                "on ROCm use --attention-backend triton (or auto)"
            )
        why = _why_unusable(requested, platform, dtype, head_dim, block_size, **exits)
        if why is not None:
            raise AttentionSelectionError(f"attention backend {requested!r} cannot run here: {why}")
        return AttentionSelection(requested, "explicitly requested")
    skipped: list[tuple[str, str]] = []
    for name in AUTO_ORDER[platform.name]:
        why = _why_unusable(name, platform, dtype, head_dim, block_size, **exits)
        if why is None:
            first = "first" if not skipped else "first usable"
            return AttentionSelection(name, f"auto: {first} of {'/'.join(AUTO_ORDER[platform.name])} on {platform.name}", tuple(skipped))
        skipped.append((name, why))
    raise AttentionSelectionError(
        f"no attention backend usable on {platform.name}: " + "; ".join(f"{n}: {w}" for n, w in skipped)
    )


def build_attention(platform: Platform, selection: AttentionSelection) -> AttentionBackend:
    return create_backend(selection.name, **backend_params(selection.name, platform))
