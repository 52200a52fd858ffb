"""Fused model kernels for GPUs (Triton), each in the Hugging Face rounding order.

* :func:`add_norm_norm` — residual add of a normalised sub-block output plus the next norm (the
  sub-block output may arrive as split-K partial sums, :class:`SplitSum`, reduced in the same pass);
* :func:`rope_qk_` — rotary embedding of q and k in place, in one launch (optionally storing the
  rotated k and the v rows into the paged KV cache in that launch);
* :func:`silu_mul` — the SwiGLU activation ``silu(gate) * up`` from the fused gate/up output.

Every function writes out each rounding point of the eager op sequence it replaces (a bf16 op in
torch computes in fp32 and rounds once; the kernels do the same) and falls back to those eager ops
where Triton cannot run. fp32 results match the eager ops to rounding (the engine stays
token-identical to the oracle on the H200); in bf16/fp16 the H200 shows small element differences
(bounded in tests/gpu/test_fused_ops_gpu.py, not yet explained: possibly the compiler folding a
cast pair), so bf16 paths meet a tolerance, not bit identity. Together they take an Ouro layer from ~25 launches to ~11.

Sandwich norm:

An Ouro layer ends each sub-block with ``h = h + RMS_b(x)`` and starts the next with
``RMS_a(h)``. :func:`add_norm_norm` does both in one pass per row: it normalises ``x`` (fp32
variance, cast to the activation dtype, times the weight in the activation dtype), adds it to the
residual ``h`` (rounded to the activation dtype), and normalises the new residual with the second
weight — one kernel instead of about a dozen elementwise launches, with every rounding point of
the eager order kept (only the order of the fp32 sum inside the variance may differ).

On devices without Triton the same function falls back to the eager ops in ``layers``.
"""

from __future__ import annotations

import abc
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rlt.attention.pdl import kernel_options
from rlt.platform.models.layers import apply_rope, rms_norm

try:  # Triton is optional: GPUs only.
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from rlt.attention.backends.triton_kernels.pdl import dependent_wait, launch_dependents
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None


if triton is not None:

    @triton.jit
    def add_norm_norm_row(H, X, W1, W2, OUT_H, OUT_N, row, stride_h, stride_x, stride_xs, stride_oh, stride_on, n_cols,
                          eps, HAS_SECOND: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
                          CACHE: tl.constexpr, PDL: tl.constexpr):
        """One row of :func:`add_norm_norm` (also run by a split-K projection that folds it in,
        ``fused_linear``: ``CACHE`` ".cg" there, as the pieces were written by other programs of that
        launch)."""
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        if SPLITS == 1:
            x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        else:  # X: fp32 split-K partial sums of the projection; their sum in split order, rounded as F.linear
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                acc += tl.load(X + s * stride_xs + row * stride_x + cols, mask=mask, other=0.0, cache_modifier=CACHE)
            x = acc.to(OUT_H.dtype.element_ty).to(tl.float32)
        var = tl.sum(x * x, axis=0) / n_cols
        xn = (x * tl.rsqrt(var + eps)).to(OUT_H.dtype.element_ty)
        w1 = tl.load(W1 + cols, mask=mask, other=0.0)
        t = (w1.to(tl.float32) * xn.to(tl.float32)).to(OUT_H.dtype.element_ty)
        h = tl.load(H + row * stride_h + cols, mask=mask, other=0.0)
        launch_dependents(PDL)
        hn = (h.to(tl.float32) + t.to(tl.float32)).to(OUT_H.dtype.element_ty)
        tl.store(OUT_H + row * stride_oh + cols, hn, mask=mask)
        if HAS_SECOND:
            hf = hn.to(tl.float32)
            var2 = tl.sum(hf * hf, axis=0) / n_cols
            n2 = (hf * tl.rsqrt(var2 + eps)).to(OUT_H.dtype.element_ty)
            w2 = tl.load(W2 + cols, mask=mask, other=0.0)
            out = (w2.to(tl.float32) * n2.to(tl.float32)).to(OUT_H.dtype.element_ty)
            tl.store(OUT_N + row * stride_on + cols, out, mask=mask)

    @triton.jit
    def _add_norm_norm_kernel(H, X, W1, W2, OUT_H, OUT_N, stride_h, stride_x, stride_xs, stride_oh, stride_on, n_cols,
                              eps, HAS_SECOND: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
                              PDL: tl.constexpr):
        dependent_wait(PDL)  # rlt.attention.pdl (a decode step chains this between projections)
        add_norm_norm_row(H, X, W1, W2, OUT_H, OUT_N, tl.program_id(0), stride_h, stride_x, stride_xs, stride_oh,
                          stride_on, n_cols, eps, HAS_SECOND, BLOCK, SPLITS, "", PDL)


    @triton.jit
    def _rope_kernel(QKV, COS, SIN, K_CACHE, V_CACHE, SLOTS, stride_tok, stride_cs, n_heads,
                     HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HEADS: tl.constexpr, NUM_Q: tl.constexpr,
                     NUM_KV: tl.constexpr, KV_HEADS: tl.constexpr, WRITE_KV: tl.constexpr):
        # One token per program, all its rotated heads at once: cos/sin are read once per token,
        # and a long prompt launches N programs, not N x heads single-warp ones. With WRITE_KV the
        # rotated k heads and the v heads also go to the token's flat KV slot (slot < 0: none).
        tok = tl.program_id(0)
        offs = tl.arange(0, HALF)
        heads = tl.arange(0, HEADS)
        mask = (heads < n_heads)[:, None]
        base = QKV + tok * stride_tok + heads[:, None] * HEAD_DIM + offs[None, :]
        x1 = tl.load(base, mask=mask)
        x2 = tl.load(base + HALF, mask=mask)
        dt = x1.dtype
        c1 = tl.load(COS + tok * stride_cs + offs).to(tl.float32)[None, :]
        c2 = tl.load(COS + tok * stride_cs + HALF + offs).to(tl.float32)[None, :]
        s1 = tl.load(SIN + tok * stride_cs + offs).to(tl.float32)[None, :]
        s2 = tl.load(SIN + tok * stride_cs + HALF + offs).to(tl.float32)[None, :]
        # x * cos + rotate_half(x) * sin, rotate_half([x1, x2]) = [-x2, x1]; each product rounded
        a1 = (x1.to(tl.float32) * c1).to(dt).to(tl.float32)
        b1 = ((-x2.to(tl.float32)) * s1).to(dt).to(tl.float32)
        a2 = (x2.to(tl.float32) * c2).to(dt).to(tl.float32)
        b2 = (x1.to(tl.float32) * s2).to(dt).to(tl.float32)
        r1 = (a1 + b1).to(dt)
        r2 = (a2 + b2).to(dt)
        tl.store(base, r1, mask=mask)
        tl.store(base + HALF, r2, mask=mask)
        if WRITE_KV:
            slot = tl.load(SLOTS + tok)
            if slot >= 0:
                row = slot.to(tl.int64) * (NUM_KV * HEAD_DIM)
                ct = K_CACHE.dtype.element_ty
                is_k = (heads >= NUM_Q) & (heads < n_heads)
                kdst = K_CACHE + row + (heads[:, None] - NUM_Q) * HEAD_DIM + offs[None, :]
                tl.store(kdst, r1.to(ct), mask=is_k[:, None])
                tl.store(kdst + HALF, r2.to(ct), mask=is_k[:, None])
                vh = tl.arange(0, KV_HEADS)
                vmask = (vh < NUM_KV)[:, None]
                vsrc = QKV + tok * stride_tok + (NUM_Q + NUM_KV + vh[:, None]) * HEAD_DIM + offs[None, :]
                vdst = V_CACHE + row + vh[:, None] * HEAD_DIM + offs[None, :]
                tl.store(vdst, tl.load(vsrc, mask=vmask).to(ct), mask=vmask)
                tl.store(vdst + HALF, tl.load(vsrc + HALF, mask=vmask).to(ct), mask=vmask)

    @triton.jit
    def _silu_mul_kernel(GU, OUT, stride_gu, stride_out, n_cols, BLOCK: tl.constexpr, ACCURATE_EXP: tl.constexpr):
        row = tl.program_id(0)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < n_cols
        g = tl.load(GU + row * stride_gu + col, mask=mask, other=0.0)
        u = tl.load(GU + row * stride_gu + n_cols + col, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        if ACCURATE_EXP:  # libdevice expf, as torch's silu (the interpreter has no libdevice)
            e = libdevice.exp(-gf)
        else:
            e = tl.exp(-gf)
        act = (gf / (1.0 + e)).to(g.dtype)
        tl.store(OUT + row * stride_out + col, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_usable(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or _interpreting())


class SplitSum(NamedTuple):
    """A projection's output still in split-K pieces: fp32 partial sums ``parts [S, M, N]`` whose sum,
    rounded to ``dtype``, is ``F.linear``'s result (``fused_linear.linear_split_k`` makes them, so that
    the reduction rides in the consumer's launch — :func:`add_norm_norm` — instead of its own)."""

    parts: torch.Tensor
    dtype: torch.dtype

    def total(self) -> torch.Tensor:
        """The projection itself (split order, one rounding): for consumers without a fused path."""
        acc = self.parts[0].clone()
        for part in self.parts[1:]:
            acc += part
        return acc.to(self.dtype)


class PendingProjection(abc.ABC):
    """A projection whose launch is left to its consumer: :func:`add_norm_norm` runs it and its own work
    in one launch (``fused_linear.linear_split_k`` with ``rlt.attention.fold`` on: the split-K program
    that stores the last piece of a row block does the add + norms); any other consumer takes
    :meth:`total`."""

    @abc.abstractmethod
    def total(self) -> torch.Tensor:
        """The projection itself, as the unfolded path computes it."""

    @abc.abstractmethod
    def add_norm_norm(self, h: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor | None, eps: float):
        """:func:`add_norm_norm` of this projection, in the projection's launch."""


def add_norm_norm(h: torch.Tensor, x: torch.Tensor | SplitSum | PendingProjection, w1: torch.Tensor,
                  w2: torch.Tensor | None, eps: float, use_triton: bool | None = None):
    """Return ``(h + RMS_w1(x), RMS_w2(h + RMS_w1(x)))`` (the second is None when ``w2`` is None).

    ``x`` may be a :class:`SplitSum`; the kernel then sums its pieces first (in split order, rounded to
    the activation dtype: the projection as ``F.linear`` returns it); or a :class:`PendingProjection`,
    which then does all of it in its own launch."""
    if use_triton is None:
        use_triton = triton_usable(h)
    if isinstance(x, PendingProjection):
        if use_triton:
            return x.add_norm_norm(h, w1, w2, eps)
        x = x.total()
    if not use_triton:
        if isinstance(x, SplitSum):
            x = x.total()
        hn = h + rms_norm(x, w1, eps)
        return hn, (rms_norm(hn, w2, eps) if w2 is not None else None)
    rows, cols = h.shape
    out_h = torch.empty_like(h)
    out_n = torch.empty_like(h) if w2 is not None else out_h
    block = triton.next_power_of_2(cols)
    xs, splits, stride_xs = (x.parts, x.parts.shape[0], x.parts.stride(0)) if isinstance(x, SplitSum) else (x, 1, 0)
    _add_norm_norm_kernel[(rows,)](
        h, xs, w1, w2 if w2 is not None else w1, out_h, out_n, h.stride(0), xs.stride(-2), stride_xs,
        out_h.stride(0), out_n.stride(0), cols, eps, HAS_SECOND=w2 is not None, BLOCK=block, SPLITS=splits,
        num_warps=4 if block <= 2048 else 8, **kernel_options(h))
    return out_h, (out_n if w2 is not None else None)


def rope_warps(heads: int, head_dim: int) -> int:
    """Warps of one :func:`rope_qk_` program (one token, ``heads`` rotated heads): about one per
    1,024 rotated values, at most 8, and a power of two as Triton requires (q + k heads of a GQA
    model, such as 16 + 8, are not one: 3 warps failed the launch on the H200, aborting the step)."""
    want = min(8, max(1, heads * head_dim // 1024))
    return 1 << (want.bit_length() - 1)


def rope_qk_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int,
             head_dim: int, use_triton: bool | None = None,
             kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """Rotate the q and k parts of the fused projection ``qkv [N, (nq + 2 nkv) d]`` in place.

    Returns views ``q [N, nq, d]``, ``k [N, nkv, d]``, ``v [N, nkv, d]`` and whether the kernel also
    stored k and v into ``kv_store = (k_cache_layer, v_cache_layer, slot_mapping)`` — the flat-slot
    ``write_kv`` of the Torch / Triton / FlashAttention backends (``k[layer].view(-1, nkv * d)[slot]
    = k_row``, slot < 0 skipped), in the same launch. When it returns False the caller writes the KV.
    """
    n = qkv.shape[0]
    qd, kd = num_q_heads * head_dim, num_kv_heads * head_dim
    if use_triton is None:
        use_triton = triton_usable(qkv)
    stored = False
    if use_triton and n and qkv.stride(-1) == 1 and (head_dim & (head_dim - 1)) == 0:
        heads = num_q_heads + num_kv_heads
        write = kv_store is not None and all(t.is_contiguous() for t in kv_store[:2])
        k_cache, v_cache, slots = kv_store if write else (qkv, qkv, qkv)
        _rope_kernel[(n,)](
            qkv, cos, sin, k_cache, v_cache, slots, qkv.stride(0), cos.stride(0), heads,
            HEAD_DIM=head_dim, HALF=head_dim // 2, HEADS=triton.next_power_of_2(heads), NUM_Q=num_q_heads,
            NUM_KV=num_kv_heads, KV_HEADS=triton.next_power_of_2(num_kv_heads), WRITE_KV=write,
            num_warps=rope_warps(heads, head_dim))
        stored = write
        q = qkv[:, :qd].view(n, num_q_heads, head_dim)
        k = qkv[:, qd:qd + kd].view(n, num_kv_heads, head_dim)
    else:
        q = apply_rope(qkv[:, :qd].reshape(n, num_q_heads, head_dim), cos, sin)
        k = apply_rope(qkv[:, qd:qd + kd].reshape(n, num_kv_heads, head_dim), cos, sin)
    v = qkv[:, qd + kd:].view(n, num_kv_heads, head_dim)
    return q, k, v, stored


def silu_mul(gate_up: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """``silu(g) * u`` for ``gate_up = [g | u]`` of shape ``[N, 2I]``."""
    if use_triton is None:
        use_triton = triton_usable(gate_up)
    inter = gate_up.shape[1] // 2
    if not use_triton or gate_up.shape[0] == 0:
        g, u = gate_up.chunk(2, dim=-1)
        return F.silu(g) * u
    out = torch.empty((gate_up.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, ACCURATE_EXP=not _interpreting(), num_warps=4)
    return out
