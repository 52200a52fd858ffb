"""Fused sandwich-norm kernels for GPUs (Triton), in the Hugging Face rounding order.

An Ouro layer ends each sub-block with ``h = h + RMS_b(x)`` and starts the next with
``RMS_a(h)``. :func:`add_norm_norm` does both in one pass per row: it normalises ``x`` (fp32
variance, cast to the activation dtype, times the weight in the activation dtype), adds it to the
residual ``h`` (rounded to the activation dtype), and normalises the new residual with the second
weight — one kernel instead of about a dozen elementwise launches, with every rounding point of
the eager order kept (only the order of the fp32 sum inside the variance may differ).

On devices without Triton the same function falls back to the eager ops in ``layers``.
"""

from __future__ import annotations

import torch

from rlt.platform.models.layers import rms_norm

try:  # Triton is optional: GPUs only.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None


if triton is not None:

    @triton.jit
    def _add_norm_norm_kernel(H, X, W1, W2, OUT_H, OUT_N, stride_h, stride_x, stride_oh, stride_on, n_cols, eps,
                              HAS_SECOND: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / n_cols
        xn = (x * tl.rsqrt(var + eps)).to(OUT_H.dtype.element_ty)
        w1 = tl.load(W1 + cols, mask=mask, other=0.0)
        t = (w1.to(tl.float32) * xn.to(tl.float32)).to(OUT_H.dtype.element_ty)
        h = tl.load(H + row * stride_h + cols, mask=mask, other=0.0)
        hn = (h.to(tl.float32) + t.to(tl.float32)).to(OUT_H.dtype.element_ty)
        tl.store(OUT_H + row * stride_oh + cols, hn, mask=mask)
        if HAS_SECOND:
            hf = hn.to(tl.float32)
            var2 = tl.sum(hf * hf, axis=0) / n_cols
            n2 = (hf * tl.rsqrt(var2 + eps)).to(OUT_H.dtype.element_ty)
            w2 = tl.load(W2 + cols, mask=mask, other=0.0)
            out = (w2.to(tl.float32) * n2.to(tl.float32)).to(OUT_H.dtype.element_ty)
            tl.store(OUT_N + row * stride_on + cols, out, mask=mask)


def triton_usable(t: torch.Tensor) -> bool:
    import os

    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def add_norm_norm(h: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor | None, eps: float,
                  use_triton: bool | None = None):
    """Return ``(h + RMS_w1(x), RMS_w2(h + RMS_w1(x)))`` (the second is None when ``w2`` is None)."""
    if use_triton is None:
        use_triton = triton_usable(h)
    if not use_triton:
        hn = h + rms_norm(x, w1, eps)
        return hn, (rms_norm(hn, w2, eps) if w2 is not None else None)
    rows, cols = h.shape
    out_h = torch.empty_like(h)
    out_n = torch.empty_like(h) if w2 is not None else out_h
    block = triton.next_power_of_2(cols)
    _add_norm_norm_kernel[(rows,)](
        h, x, w1, w2 if w2 is not None else w1, out_h, out_n, h.stride(0), x.stride(0), out_h.stride(0),
        out_n.stride(0), cols, eps, HAS_SECOND=w2 is not None, BLOCK=block, num_warps=4 if block <= 2048 else 8)
    return out_h, (out_n if w2 is not None else None)
