"""Choosing the attention backend for a platform.

``auto`` order (RFC §3): CUDA prefers FA4, FA3, FA2 (whichever import), then Triton, then Torch;
ROCm considers Triton then Torch and never imports FlashAttention; NPU uses ``ascend_eager``; CPU
uses Torch. A candidate is skipped only when it is unavailable or unsuitable (missing package,
wrong arch, dtype, head size, block size), and the skip reason is recorded. An explicit request
never falls back: it either works or raises :class:`AttentionSelectionError` naming the cause.

Prefill and decode owners (``fa4+triton``): on CUDA FlashAttention owns packed prefill (RFC §3),
but in decode-only steps the Triton kernels win (FA4 has no split-KV on SM90: one 32K row runs 6x
slower than Triton's split-KV kernel on the H200). So when ``auto`` picks a FlashAttention backend and Triton is
usable too, the selection is the pair ``<fa>+triton``: FA for steps holding prompt chunks, Triton
for decode-only steps (``rlt.attention.backends.prefill_decode``). A pair may also be requested
explicitly; each part must be usable.

LAST_EXITED and FlashAttention: FA kernels read one page table per row, so they cannot apply the
per-token version map (spec ``depth_indirection=False``). They are exact under SHARED, and under
LAST_EXITED only when no request can exit early (fixed depth: every context token reached every
plane a query reads). The caller declares that with ``kv_layout`` and ``adaptive_exit``; when it
does not (``None``), an FA backend is treated as unsuitable for LAST_EXITED rather than risk
silently reading the wrong plane.
"""

from __future__ import annotations

import os

import attrs
import torch

from rlt.attention import BACKENDS, AttentionBackend, KVLayout, UnsuitableBackend, create_backend
from rlt.attention.backends.prefill_decode import PrefillDecodeBackend
from rlt.platform.platforms import Capability, Platform

AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("fa4", "fa3", "fa2", "triton", "torch"),
    "rocm": ("triton", "torch"),
    "npu": ("ascend_eager",),
    "cpu": ("torch",),
}
#: FlashAttention generations by minimum / exact SM arch.
_FA_ARCH = {"fa4": ("sm90", "sm100", "sm103", "sm110", "sm120"), "fa3": ("sm90",), "fa2": None}
#: Prefill backend + decode backend pairs (see the module docstring).
PAIRS = tuple(f"{fa}+triton" for fa in ("fa4", "fa3", "fa2"))
ATTENTION_CHOICES = ("auto", *BACKENDS, *PAIRS)


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
    # on CPU, Triton's interpreter runs the kernels on CPU tensors (tests; auto never chooses it)
    interpreted = platform.name == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    if name == "triton" and not platform.has(Capability.TRITON) and not interpreted:
        return (f"platform {platform.name} does not declare Triton"
                + (" (TRITON_INTERPRET=1 runs its kernels in Triton's interpreter, for tests)"
                   if platform.name == "cpu" else ""))
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

    def why(name: str) -> str | None:
        return _why_unusable(name, platform, dtype, head_dim, block_size, kv_layout=kv_layout,
                             adaptive_exit=adaptive_exit)

    if requested != "auto":
        if requested not in ATTENTION_CHOICES:
            raise AttentionSelectionError(
                f"unknown attention backend {requested!r}; choose one of {', '.join(ATTENTION_CHOICES)}"
            )
        for part in requested.split("+"):
            if BACKENDS[part].vendor == "nvidia" and platform.name == "rocm":
                raise AttentionSelectionError(
                    f"attention backend {requested!r} is FlashAttention, which rlt supports on NVIDIA GPUs only; "
                    "on ROCm use --attention-backend triton (or auto)"
                )
            reason = why(part)
            if reason is not None:
                raise AttentionSelectionError(f"attention backend {requested!r} cannot run here: {part}: {reason}")
        return AttentionSelection(requested, "explicitly requested")
    skipped: list[tuple[str, str]] = []
    order = AUTO_ORDER[platform.name]
    for name in order:
        reason = why(name)
        if reason is not None:
            skipped.append((name, reason))
            continue
        first = "first" if not skipped else "first usable"
        chosen = f"auto: {first} of {'/'.join(order)} on {platform.name}"
        if f"{name}+triton" in PAIRS and why("triton") is None:
            return AttentionSelection(f"{name}+triton", chosen + f"; {name} for steps with prompt chunks, triton for "
                                      "decode-only steps", tuple(skipped))
        return AttentionSelection(name, chosen, tuple(skipped))
    raise AttentionSelectionError(
        f"no attention backend usable on {platform.name}: " + "; ".join(f"{n}: {w}" for n, w in skipped)
    )


def build_attention(platform: Platform, selection: AttentionSelection) -> AttentionBackend:
    parts = [create_backend(name, **backend_params(name, platform)) for name in selection.name.split("+")]
    return parts[0] if len(parts) == 1 else PrefillDecodeBackend(*parts)
