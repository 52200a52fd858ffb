"""Linear layers for decode-sized batches (few rows), with their elementwise tails fused in (Triton).

A decode step multiplies a handful of rows by every weight of the stack: the time is the weight
bytes plus, per kernel, a launch and a ramp-up/tail of a few microseconds. Two layer parts end in
elementwise work that cuBLAS cannot take into its epilogue, and cost a GEMM launch plus one or two
small kernels each; these kernels do each part in one launch, streaming each weight row once and
keeping every row of the batch in one ``tl.dot`` tile (M padded to 16 for the tensor cores; the
extra rows are free next to the weight traffic):

* :func:`linear_silu_mul` — the SwiGLU MLP's ``silu(x @ G.T) * (x @ U.T)`` from the fused
  ``[G; U]`` weight (replaces the gate/up GEMM and :func:`~rlt.platform.models.fused_ops.silu_mul`);
* :func:`linear_split_k` — a plain projection as split-K fp32 pieces, for a consumer that sums them
  (:func:`~rlt.platform.models.fused_ops.add_norm_norm`);
* :func:`linear_rope_kv` — the fused q/k/v projection, split-half RoPE on the q and k heads, and
  (optionally) the paged KV store of the k and v heads at their flat slots (replaces the qkv GEMM,
  :func:`~rlt.platform.models.fused_ops.rope_qk_` and the backend's ``write_kv``).

The plain projections that an ``add_norm_norm`` consumes (o_proj, down_proj) run as split-K partial
sums, :func:`linear_split_k`: cuBLAS gives a one-row GEMV at [2048, 5632] a single wave of 64 column
blocks (~2.1 TB/s), while K ranges of >= 1,024 columns give the grid two to four times the programs,
and the fp32 pieces are summed by the consumer kernel in its own pass (no extra launch). H200, with
the norm that follows: down_proj 13.5 -> 11.3 us, o_proj 8.1 -> 7.4 us at one row; 14.2 -> 12.6
and 8.7 -> 8.1 us at 64 rows (lease 7). The LM head stays on cuBLAS (a wide N fills the GPU).
The first kernels, before split-K: qkv + RoPE + KV store 16.2 -> 10.0 us and gate/up + SiLU
15.3 -> 14.1 us at one row, 18.2 -> 12.1 and 17.9 -> 16.5 us at 64 rows (``benchmarks/decode_kernels.py``).

Rounding follows the eager op sequence they replace (a bf16 op computes in fp32 and rounds once):
the projection is rounded to the activation dtype before RoPE / SiLU, each RoPE product and the
SiLU output are rounded as torch rounds them. The fp32 accumulation order inside the dot differs
from cuBLAS (as any two GEMM kernels do); fp32 uses exact ("ieee") dots.

The dispatch (:func:`small_m_usable`) is decided from shapes and the device only, so a captured
graph replays the same kernels: Triton on CUDA/ROCm tensors (or the interpreter), at most
``max_rows`` rows; anything else takes the eager ops. ``RLT_FUSED_LINEAR=0`` turns the kernels
off, ``RLT_SPLIT_K=0`` only the split-K projections (A/B measurements; read at import). Tiles come from :func:`_tiles` (the H200 sweep above)
or, for an A/B of a sweep's winner end to end, from ``RLT_LINEAR_TILES`` (:func:`parse_tile_overrides`);
``Tiles.tma`` reads X and W tiles through TMA descriptors (:func:`_dot2_tma`) instead of pointer loads.

Two device-side options, both off by default until an H200 A/B measures them (``docs/decode.md``):
with ``rlt.attention.fold`` on, a split-K projection of at most :data:`MAX_ROWS_FOLD` rows comes back as
a :class:`~rlt.platform.models.fused_ops.PendingProjection` that ``add_norm_norm`` launches with its own
work folded in (the program storing a row block's last piece normalises those rows); with
``RLT_PREFETCH=1`` (and PDL) each kernel asks L2 for its weight rows before ``griddepcontrol.wait``.

The KV store in :func:`linear_rope_kv` writes the same thing at the same place as the flat-slot
``write_kv`` of the Torch / Triton / FlashAttention backends (``k[layer].view(-1, kv_heads * d)
[slot] = k_row``; a negative slot writes nothing); a backend that stores KV differently declares
``BackendSpec.flat_slot_kv_write = False`` and the model keeps calling its ``write_kv``.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rlt.attention.backends.triton_backend import num_sms as _sm_count, tma_descriptor, tma_ready
from rlt.attention.fold import fold_capable, fold_enabled
from rlt.attention.pdl import kernel_options, weight_prefetch
from rlt.platform.models.fused_ops import (PendingProjection, SplitSum, _interpreting, rope_qk_, silu_mul,
                                          triton)

ROW_LIMIT_KINDS = ("rope_kv", "silu_mul", "split_k")


def parse_row_limits(text: str) -> dict[str, int]:
    """``RLT_FUSED_ROWS``: comma-separated ``KIND=ROWS`` (KIND one of :data:`ROW_LIMIT_KINDS`), the most rows
    that kernel serves instead of its default limit, every row count up to it (e.g. ``silu_mul=64,split_k=64``:
    the limits before lease 13, cuBLAS above 64 rows; ``silu_mul=128,split_k=128``: the 65-95 rows of
    :data:`CUBLAS_ROWS` too). Read once at import, for A/B measurements. A malformed entry raises ValueError
    naming it."""
    out: dict[str, int] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        kind, _, rows = entry.partition("=")
        if kind not in ROW_LIMIT_KINDS or not rows.isdigit() or int(rows) < 1:
            raise ValueError(f"RLT_FUSED_ROWS entry {entry!r}: expected KIND=ROWS with KIND one of "
                             f"{', '.join(ROW_LIMIT_KINDS)} and ROWS a positive integer")
        out[kind] = int(rows)
    return out


_ROW_LIMITS = parse_row_limits(os.environ.get("RLT_FUSED_ROWS", ""))
#: Most rows each fused kernel serves (above it the GEMM + elementwise kernels were as fast); ``RLT_FUSED_ROWS``
#: moves them for an A/B run.
MAX_ROWS_ROPE_KV = _ROW_LIMITS.get("rope_kv", 128)
MAX_ROWS_SILU_MUL = _ROW_LIMITS.get("silu_mul", 128)
MAX_ROWS_SPLIT_K = _ROW_LIMITS.get("split_k", 128)
#: Rows the gate/up + SiLU and split-K kernels leave to cuBLAS (+ the elementwise kernels) under those limits.
#: Above 64 rows they take every row in one 128-row block read through TMA (:func:`_tiles`, :func:`split_plan`),
#: which loses to cuBLAS's own tiles at 65 rows and wins from 96 — an H100, lease 13, decode tok/s against cuBLAS:
#: -1.0 % at C=65 (lease 12: -0.9 %), +1.1 % at C=96, +1.6 % at C=115
#: (``benchmarks/results/h100-20261206-lease13``). Without TMA (ROCm, pre-Hopper, unaligned rows) they serve at
#: most 64 rows. A kind ``RLT_FUSED_ROWS`` names serves every row count up to its limit.
CUBLAS_ROWS = range(65, 96)

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    from rlt.attention.backends.triton_kernels.fold import last_arrival, reset_counter, split_tile_sum
    from rlt.attention.backends.triton_kernels.pdl import dependent_wait, launch_dependents, prefetch_rows_l2
    from rlt.platform.models.fused_ops import add_norm_norm_row

    @triton.jit
    def _dot2(X, W, rows_a, rows_b, mask_a, mask_b, offs_m, mask_m, K: tl.constexpr, stride_xm, stride_wn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              TWO: tl.constexpr, PRECISION: tl.constexpr):
        """``X[offs_m] @ W[rows_a].T`` (and ``@ W[rows_b].T`` when TWO) in fp32."""
        acc_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        wa_ptrs = W + rows_a[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        wb_ptrs = W + rows_b[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
                wa = tl.load(wa_ptrs, mask=mask_a[:, None], other=0.0)
            else:
                mk = (k + offs_k) < K
                x = tl.load(x_ptrs, mask=mask_m[:, None] & mk[None, :], other=0.0)
                wa = tl.load(wa_ptrs, mask=mask_a[:, None] & mk[None, :], other=0.0)
            acc_a = tl.dot(x, tl.trans(wa), acc_a, input_precision=PRECISION)
            if TWO:
                if EVEN_K:
                    wb = tl.load(wb_ptrs, mask=mask_b[:, None], other=0.0)
                else:
                    wb = tl.load(wb_ptrs, mask=mask_b[:, None] & mk[None, :], other=0.0)
                acc_b = tl.dot(x, tl.trans(wb), acc_b, input_precision=PRECISION)
            x_ptrs += BLOCK_K
            wa_ptrs += BLOCK_K
            wb_ptrs += BLOCK_K
        return acc_a, acc_b

    @triton.jit
    def _dot2_tma(XD, WD, m0, row_a, row_b, k0, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, TWO: tl.constexpr, PRECISION: tl.constexpr):
        """:func:`_dot2` with X and W read through TMA descriptors: rows ``[m0, m0 + BLOCK_M)`` of X times
        weight rows ``[row_a, row_a + BLOCK_N)`` (and ``row_b``'s when TWO) over columns ``[k0, k0 + K)``;
        the descriptors' bounds read zeros past M rows, past N rows and past K (no masks)."""
        acc_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x = XD.load([m0, k0 + k])
            wa = WD.load([row_a, k0 + k])
            acc_a = tl.dot(x, tl.trans(wa), acc_a, input_precision=PRECISION)
            if TWO:
                wb = WD.load([row_b, k0 + k])
                acc_b = tl.dot(x, tl.trans(wb), acc_b, input_precision=PRECISION)
        return acc_a, acc_b

    @triton.jit(do_not_specialize=["M"])  # rows vary per step (module docstring)
    def _linear_silu_mul_kernel(X, W, OUT, PARTS, CNT, M, I, K: tl.constexpr, stride_xm, stride_wn, stride_om,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                EVEN_K: tl.constexpr, PRECISION: tl.constexpr, ACCURATE_EXP: tl.constexpr,
                                PDL: tl.constexpr, PREFETCH: tl.constexpr = False, LINE: tl.constexpr = 64,
                                LINES: tl.constexpr = 1, SPLITS: tl.constexpr = 1, TMA: tl.constexpr = False):
        """One program: gate rows ``[j*B, j*B+B)`` and their up rows over K split ``program_id(2)`` of
        ``SPLITS`` (the last program of a tile sums the pieces and applies SiLU·mul: ``split_tile_sum``).
        TMA: X and W are TMA descriptors (the last tile's gate rows past I read up rows: their columns are
        never stored)."""
        K_SPLIT: tl.constexpr = K // SPLITS
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(2)
        k0 = split * K_SPLIT
        if not TMA:
            prefetch_rows_l2(W, cols, 2 * I, stride_wn, k0, K_SPLIT, LINE, LINES, PREFETCH)
            prefetch_rows_l2(W, cols + I, 2 * I, stride_wn, k0, K_SPLIT, LINE, LINES, PREFETCH)
        dependent_wait(PDL)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_n, mask_m = cols < I, offs_m < M
        if TMA:
            j = tl.program_id(0) * BLOCK_N
            acc_g, acc_u = _dot2_tma(X, W, tl.program_id(1) * BLOCK_M, j, j + I, k0, K_SPLIT, BLOCK_M, BLOCK_N,
                                     BLOCK_K, True, PRECISION)
        else:
            acc_g, acc_u = _dot2(X + k0, W + k0, cols, cols + I, mask_n, mask_n, offs_m, mask_m, K_SPLIT, stride_xm,
                                 stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, True, PRECISION)
        launch_dependents(PDL)
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        acc_g, acc_u, finish = split_tile_sum(acc_g, acc_u, PARTS, CNT, tile, split, M - tl.program_id(1) * BLOCK_M,
                                              SPLITS, BLOCK_M, BLOCK_N)
        if finish:
            dt = OUT.dtype.element_ty
            g = acc_g.to(dt).to(tl.float32)  # the gate/up GEMM output, rounded as F.linear rounds it
            u = acc_u.to(dt).to(tl.float32)
            if ACCURATE_EXP:  # libdevice expf, as torch's silu (the interpreter has no libdevice)
                e = libdevice.exp(-g)
            else:
                e = tl.exp(-g)
            act = (g / (1.0 + e)).to(dt).to(tl.float32)
            tl.store(OUT + offs_m[:, None].to(tl.int64) * stride_om + cols[None, :], (act * u).to(dt),
                     mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit(do_not_specialize=["M"])
    def _linear_rope_kv_kernel(X, W, OUT, COS, SIN, K_CACHE, V_CACHE, SLOTS, PARTS, CNT,
                               M, K: tl.constexpr, stride_xm, stride_wn, stride_om, stride_cs,
                               NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               EVEN_K: tl.constexpr, PRECISION: tl.constexpr, WRITE_KV: tl.constexpr,
                               PDL: tl.constexpr, PREFETCH: tl.constexpr = False, LINE: tl.constexpr = 64,
                               LINES: tl.constexpr = 1, SPLITS: tl.constexpr = 1, TMA: tl.constexpr = False):
        """One program: rows ``[j*B, j*B+B)`` and ``[half + j*B, ...)`` of one head (RoPE partners) over K
        split ``program_id(2)`` of ``SPLITS`` (the last program of a tile sums the pieces and finishes).
        TMA: X and W are TMA descriptors."""
        HALF: tl.constexpr = HEAD_DIM // 2
        CHUNKS: tl.constexpr = HALF // BLOCK_N
        K_SPLIT: tl.constexpr = K // SPLITS
        pid = tl.program_id(0)
        head = pid // CHUNKS
        dims_a = (pid % CHUNKS) * BLOCK_N + tl.arange(0, BLOCK_N)
        dims_b = dims_a + HALF
        split = tl.program_id(2)
        k0 = split * K_SPLIT
        all_rows: tl.constexpr = (NUM_Q + 2 * NUM_KV) * HEAD_DIM
        if not TMA:
            prefetch_rows_l2(W, head * HEAD_DIM + dims_a, all_rows, stride_wn, k0, K_SPLIT, LINE, LINES, PREFETCH)
            prefetch_rows_l2(W, head * HEAD_DIM + dims_b, all_rows, stride_wn, k0, K_SPLIT, LINE, LINES, PREFETCH)
        dependent_wait(PDL)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        all_n = dims_a < HALF
        if TMA:
            row = head * HEAD_DIM + (pid % CHUNKS) * BLOCK_N
            acc_a, acc_b = _dot2_tma(X, W, tl.program_id(1) * BLOCK_M, row, row + HALF, k0, K_SPLIT, BLOCK_M, BLOCK_N,
                                     BLOCK_K, True, PRECISION)
        else:
            acc_a, acc_b = _dot2(X + k0, W + k0, head * HEAD_DIM + dims_a, head * HEAD_DIM + dims_b, all_n, all_n,
                                 offs_m, mask_m, K_SPLIT, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, True,
                                 PRECISION)
        launch_dependents(PDL)
        tile = pid * tl.num_programs(1) + tl.program_id(1)
        acc_a, acc_b, finish = split_tile_sum(acc_a, acc_b, PARTS, CNT, tile, split, M - tl.program_id(1) * BLOCK_M,
                                              SPLITS, BLOCK_M, BLOCK_N)
        if finish:
            _rope_kv_epilogue(acc_a, acc_b, OUT, COS, SIN, K_CACHE, V_CACHE, SLOTS, head, dims_a, dims_b, offs_m,
                              mask_m, stride_om, stride_cs, NUM_Q, NUM_KV, HEAD_DIM, WRITE_KV)

    @triton.jit
    def _rope_kv_epilogue(acc_a, acc_b, OUT, COS, SIN, K_CACHE, V_CACHE, SLOTS, head, dims_a, dims_b, offs_m, mask_m,
                          stride_om, stride_cs, NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                          WRITE_KV: tl.constexpr):
        """Round the projection, rotate q / k heads, store the row and (WRITE_KV) the k / v heads' KV."""
        dt = OUT.dtype.element_ty
        xa = acc_a.to(dt)
        xb = acc_b.to(dt)
        if head < NUM_Q + NUM_KV:  # q and k heads: x * cos + rotate_half(x) * sin, each product rounded
            cs = offs_m[:, None].to(tl.int64) * stride_cs
            mask_cs = mask_m[:, None]
            ca = tl.load(COS + cs + dims_a[None, :], mask=mask_cs, other=0.0).to(tl.float32)
            cb = tl.load(COS + cs + dims_b[None, :], mask=mask_cs, other=0.0).to(tl.float32)
            sa = tl.load(SIN + cs + dims_a[None, :], mask=mask_cs, other=0.0).to(tl.float32)
            sb = tl.load(SIN + cs + dims_b[None, :], mask=mask_cs, other=0.0).to(tl.float32)
            fa = xa.to(tl.float32)
            fb = xb.to(tl.float32)
            ra = ((fa * ca).to(dt).to(tl.float32) + ((-fb) * sa).to(dt).to(tl.float32)).to(dt)
            rb = ((fb * cb).to(dt).to(tl.float32) + (fa * sb).to(dt).to(tl.float32)).to(dt)
        else:
            ra = xa
            rb = xb
        out = OUT + offs_m[:, None].to(tl.int64) * stride_om + head * HEAD_DIM
        tl.store(out + dims_a[None, :], ra, mask=mask_m[:, None])
        tl.store(out + dims_b[None, :], rb, mask=mask_m[:, None])
        if WRITE_KV:
            if head >= NUM_Q:
                slot = tl.load(SLOTS + offs_m, mask=mask_m, other=-1)
                is_v = head >= NUM_Q + NUM_KV
                kv_head = head - NUM_Q - is_v.to(tl.int32) * NUM_KV
                dst = slot[:, None].to(tl.int64) * (NUM_KV * HEAD_DIM) + kv_head * HEAD_DIM
                keep = mask_m[:, None] & (slot[:, None] >= 0)
                ct = K_CACHE.dtype.element_ty
                tl.store(K_CACHE + dst + dims_a[None, :], ra.to(ct), mask=keep & (not is_v))
                tl.store(K_CACHE + dst + dims_b[None, :], rb.to(ct), mask=keep & (not is_v))
                tl.store(V_CACHE + dst + dims_a[None, :], ra.to(ct), mask=keep & is_v)
                tl.store(V_CACHE + dst + dims_b[None, :], rb.to(ct), mask=keep & is_v)

    @triton.jit(do_not_specialize=["M"])
    def _linear_split_k_kernel(X, W, PARTS, M, N, K_SPLIT: tl.constexpr, stride_xm, stride_wn, stride_ps, stride_pm,
                               CNT, H, W1, W2, OUT_H, OUT_N, stride_h, stride_oh, stride_on, eps,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               EVEN_K: tl.constexpr, PRECISION: tl.constexpr, FOLD: tl.constexpr,
                               SPLITS: tl.constexpr, HAS_SECOND: tl.constexpr, BLOCK_ROW: tl.constexpr,
                               PDL: tl.constexpr, PREFETCH: tl.constexpr = False, LINE: tl.constexpr = 64,
                               LINES: tl.constexpr = 1, TMA: tl.constexpr = False):
        """One program: weight rows ``[j*B, j*B+B)`` over the K range of split ``program_id(1)``. With FOLD
        the program storing the last piece of its row block runs ``add_norm_norm`` on those rows
        (``H``, ``W1``, ``W2`` -> ``OUT_H``, ``OUT_N``; ``CNT``: one zeroed ticket counter per row block).
        TMA: X and W are TMA descriptors."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        if not TMA:
            prefetch_rows_l2(W, cols, N, stride_wn, split * K_SPLIT, K_SPLIT, LINE, LINES, PREFETCH)
        dependent_wait(PDL)
        offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_n, mask_m = cols < N, offs_m < M
        k0 = split * K_SPLIT
        if TMA:
            acc, _ = _dot2_tma(X, W, tl.program_id(2) * BLOCK_M, tl.program_id(0) * BLOCK_N, 0, k0, K_SPLIT, BLOCK_M,
                               BLOCK_N, BLOCK_K, False, PRECISION)
        else:
            acc, _ = _dot2(X + k0, W + k0, cols, cols, mask_n, mask_n, offs_m, mask_m, K_SPLIT, stride_xm, stride_wn,
                           BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, False, PRECISION)
        launch_dependents(PDL)
        tl.store(PARTS + split * stride_ps + offs_m[:, None].to(tl.int64) * stride_pm + cols[None, :], acc,
                 mask=mask_m[:, None] & mask_n[None, :])
        if FOLD:
            counter = CNT + tl.program_id(2)
            if last_arrival(counter, tl.num_programs(0) * tl.num_programs(1)):
                for r in range(BLOCK_M):
                    row = tl.program_id(2) * BLOCK_M + r
                    if row < M:
                        add_norm_norm_row(H, PARTS, W1, W2, OUT_H, OUT_N, row, stride_h, stride_pm, stride_ps,
                                          stride_oh, stride_on, N, eps, HAS_SECOND, BLOCK_ROW, SPLITS, ".cg", False)
                reset_counter(counter)


#: ``RLT_FUSED_LINEAR`` / ``RLT_SPLIT_K`` / ``RLT_SPLIT_K_TMA``, read once at import (A/B switches set per process; a launch
#: does not pay for environment lookups — eager decode paths are host-bound).
_FUSED = os.environ.get("RLT_FUSED_LINEAR", "1") != "0"
_SPLIT_K = os.environ.get("RLT_SPLIT_K", "1") != "0"
#: ``RLT_SPLIT_K_TMA`` (on unless 0): the split-K projections read X and W through TMA (``Tiles.tma``) where
#: they can. H200, lease 9, back to back: C=1 decode 188.8 -> 190.3 tok/s, C=64 3,445 -> 3,460 (the default's
#: four runs that lease spread 188.6-188.9 and 3,445-3,446)
_SPLIT_K_TMA = os.environ.get("RLT_SPLIT_K_TMA", "1") != "0"


def small_m_usable(x: torch.Tensor, weight: torch.Tensor, max_rows: int) -> bool:
    """Whether the decode-sized kernels serve ``x @ weight.T`` (shape and device only: graph-safe)."""
    return (triton is not None and _FUSED and 0 < x.shape[0] <= max_rows and x.dim() == 2
            and (x.is_cuda or _interpreting()) and x.dtype == weight.dtype and x.stride(-1) == 1
            and weight.stride(-1) == 1)


def leaves_to_cublas(kind: str, m: int, tma: bool) -> bool:
    """Whether the ``kind`` kernel ("silu_mul" or "split_k") leaves ``m`` rows (within its limit) to cuBLAS:
    above 64 rows it serves only through TMA (``tma``: the device and operands allow it) and outside
    :data:`CUBLAS_ROWS`, unless ``RLT_FUSED_ROWS`` names the kind."""
    if m <= ROW_BUCKETS[-1] or kind in _ROW_LIMITS:
        return False
    return not tma or m in CUBLAS_ROWS


class Tiles(NamedTuple):
    """Launch shape: rows per dot tile (>= 16), weight rows and K columns per step, warps, stages, and
    whether the fused projections load X and W through TMA descriptors (where the device and the tensors
    allow it: ``rlt.attention.backends.triton_backend.tma_ready``; else the pointer loads)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    tma: bool = False


#: Row-count buckets of the default launch shapes and of their overrides: at most 16 rows, at most 64 (C=64's
#: decode steps), more.
ROW_BUCKETS = (16, 64)


def row_bucket(m: int) -> int:
    """The :data:`ROW_BUCKETS` bucket of ``m`` rows: 0 (at most 16), 1 (at most 64) or 2 (more)."""
    return sum(m > b for b in ROW_BUCKETS)


def _tiles(m: int, kind: str, tma: bool = False) -> Tiles:
    """The tiles of ``kind`` ("rope_kv" or "silu_mul") for ``m`` rows (the H200 sweeps' best); ``tma``: the
    device and both operands allow TMA loads (:func:`_operands`). Above 16 rows those read X and W through
    TMA: lease 9's sweep at 64 rows (``benchmarks/results/h200-20261205-lease9``) gave q/k/v + RoPE 11.7 ->
    11.1 us and gate/up + SiLU 16.3 -> 14.9 us (64-wide tiles on 8 warps), and C=64 decode 3,446 -> 3,486
    tok/s end to end; K splits lost there. Above 64 rows q/k/v + RoPE takes every row in one 128-row block
    (an H100, lease 12: the 128-row sweep's best, 20.1 -> 14.8 us at 128 rows; C=65 decode with rlt-prefill
    2,473 -> 2,526 tok/s, twice, back to back — ``benchmarks/results/h100-20261206-lease12``). At 16 rows or
    fewer the pointer tiles stay (lease 12's one-row sweep through TMA found nothing 3 % faster). gate/up + SiLU
    above 64 rows: one 128-row block too (lease 11's winner, 23.9 us on cuBLAS + SiLU -> 20.9 at 128 rows on an
    H100), from 96 rows (:data:`CUBLAS_ROWS`)."""
    bucket = row_bucket(m)
    if bucket == 0:
        return Tiles(16, 32, 256 if kind == "rope_kv" else 128, 4, 4)
    if tma and bucket == 2:  # one 128-row block (lease 11's 128-row sweep; gate/up + SiLU: :data:`CUBLAS_ROWS`)
        return Tiles(128, 32, 128, 4, 4, True) if kind == "rope_kv" else Tiles(128, 64, 128, 8, 3, True)
    if tma:
        return Tiles(64, 32, 256, 4, 3, True) if kind == "rope_kv" else Tiles(64, 64, 128, 8, 4, True)
    return Tiles(64, 32, 128, 4, 4 if kind == "rope_kv" else 3)


TILE_KINDS = ("rope_kv", "silu_mul", "split_k")

def parse_tile_overrides(text: str) -> dict[tuple[str, int], tuple[Tiles, int | None]]:
    """``RLT_LINEAR_TILES``: comma-separated ``KIND:ROWS=BMxBNxBKxWARPSxSTAGES[xTMA][/SPLITS]`` (KIND one of
    :data:`TILE_KINDS`; TMA 1: :attr:`Tiles.tma`), e.g. ``silu_mul:64=64x64x128x8x3/2``. An entry serves every
    row count of ROWS' bucket (:func:`row_bucket`: at most 16 rows, 17-64, more). For the fused projections
    SPLITS > 1 sums K splits with the fold's last program (needs a fold-capable device, not ``RLT_FOLD``); for
    ``split_k`` (the o_proj / down_proj split-K plans, :func:`split_plan`) it replaces the rule's split count;
    no SPLITS keeps the rule's count. Keys are ``(kind, row_bucket(ROWS))``. A malformed entry raises
    ValueError naming it."""
    out: dict[tuple[str, int], tuple[Tiles, int | None]] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        try:
            key, shape = entry.split("=")
            kind, rows = key.split(":")
            dims, _, splits = shape.partition("/")
            values = [int(v) for v in dims.lower().split("x")]
            if len(values) not in (5, 6) or values[5:] not in ([], [0], [1]):
                raise ValueError
            tiles = Tiles(*values[:5], bool(values[5:] and values[5]))
            count = int(splits) if splits else None
            if kind not in TILE_KINDS or int(rows) < 1 or (count is not None and count < 1):
                raise ValueError
            if min(tiles[:5]) < 1 or tiles.block_m < 16 or any(v & (v - 1) for v in tiles[:4]):  # Triton: 2^n warps
                raise ValueError
        except (ValueError, TypeError):
            raise ValueError(f"RLT_LINEAR_TILES entry {entry!r}: expected KIND:ROWS=BMxBNxBKxWARPSxSTAGES[xTMA][/SPLITS] "
                             f"with KIND one of {', '.join(TILE_KINDS)}, power-of-two BM >= 16, BN, BK, WARPS, TMA 0 or 1") from None
        out[(kind, row_bucket(int(rows)))] = (tiles, count)
    return out


_TILE_OVERRIDES = parse_tile_overrides(os.environ.get("RLT_LINEAR_TILES", ""))


def _launch_shape(m: int, kind: str, tiles: Tiles | None, splits: int | None,
                  tma: bool = False) -> tuple[Tiles, int | None]:
    """The caller's launch shape, else ``RLT_LINEAR_TILES``' entry for ``m``'s bucket, else the defaults
    (``tma``: TMA loads possible, :func:`_tiles`)."""
    if tiles is not None:
        return tiles, splits
    return _TILE_OVERRIDES.get((kind, row_bucket(m)), (_tiles(m, kind, tma), splits))


#: Shared memory a program's pipeline buffers may use (H100/H200 allow 227 KiB; keep headroom).
SHARED_MEMORY_BYTES = 200 * 1024


def _fit(tiles: Tiles, k: int, elem: int) -> Tiles:
    """``tiles`` with the K tile no wider than K and the stage buffers (x tile + two weight tiles
    per stage, ``elem`` bytes each) inside shared memory: fp32 halves what bf16 fits."""
    t = tiles._replace(block_k=min(tiles.block_k, max(16, triton.next_power_of_2(k))))
    while t.num_stages * (t.block_m + 2 * t.block_n) * t.block_k * elem > SHARED_MEMORY_BYTES:
        if t.block_k > 64:
            t = t._replace(block_k=t.block_k // 2)
        elif t.num_stages > 2:
            t = t._replace(num_stages=t.num_stages - 1)
        else:
            break
    return t


def _prefetch(x: torch.Tensor, row_elems: int) -> dict:
    """The weight-prefetch constexprs of a launch (``rlt.attention.pdl.weight_prefetch``): one L2 line
    (128 bytes) per request, ``row_elems`` of each row the program streams."""
    if not weight_prefetch(x):
        return _NO_PREFETCH
    line = 128 // x.element_size()
    return {"PREFETCH": True, "LINE": line, "LINES": triton.next_power_of_2(-(-row_elems // line))}


_NO_PREFETCH = {"PREFETCH": False}


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


class SplitPlan(NamedTuple):
    """A split-K launch: its tiles and how many K ranges (``splits``) the weight is cut into."""

    tiles: Tiles
    splits: int


#: Shortest K range one split-K program streams: splits shorter than this lost to fewer, longer ones on the
#: H200 (o_proj [2048, 2048] at one row: 8 splits of 256 took 8.8 us with its add_norm_norm, 2 of 1024
#: 7.4 us, cuBLAS 8.1 us; down_proj [2048, 5632]: 4 splits of 1408 took 11.3 us, cuBLAS 13.5 us —
#: benchmarks/results/h200-20261204-lease7). Read when a shape is first planned (split_plan is cached).
MIN_SPLIT_K = 1024


@functools.lru_cache(maxsize=1024)  # asked at every launch (eager steps are host-bound); pure in its ints
def split_plan(m: int, n: int, k: int, elem: int = 2) -> SplitPlan | None:
    """The split-K launch for ``[m, k] @ [n, k].T``: the most splits (2, 4 or 8) whose K ranges are at
    least :data:`MIN_SPLIT_K` long and whole K tiles (the widest of 256, 128, 64, 32 columns that
    divides them); None when no split fits (the caller keeps cuBLAS). Column tiles of 32 weight rows,
    16 or 64 batch rows per dot tile; read through TMA unless ``RLT_SPLIT_K_TMA=0``. An ``RLT_LINEAR_TILES``
    ``split_k`` entry for ``m``'s bucket replaces the tiles (and the count, if it gives one) wherever its K
    tiles divide this shape's K ranges; elsewhere the rule's plan stands. Entries are swept in 2-byte elements:
    wider ones narrow the K tile so the stage buffers keep the bytes the sweep ran (an fp32 run of a bf16
    winner ran out of shared memory before, lease 12)."""
    bucket = row_bucket(m)
    bm = 16 if bucket == 0 else 64
    plan = next((SplitPlan(_fit(Tiles(bm, 32, bk, 4, 4, _SPLIT_K_TMA), k // splits, elem), splits)
                 for splits in (8, 4, 2) if k // splits >= MIN_SPLIT_K
                 for bk in (256, 128, 64, 32) if k % (splits * bk) == 0), None)
    def swept(tiles: Tiles) -> Tiles:  # tiles timed in 2-byte elements: the same stage bytes for wider ones
        return tiles._replace(block_k=max(16, tiles.block_k * 2 // max(2, elem)))

    if plan is not None and bucket == 2 and k % (plan.splits * 128) == 0:
        # above 64 rows (:data:`CUBLAS_ROWS`), every row in one 128-row block: lease 11's 128-row sweep (an H100,
        # down_proj + add_norm_norm 17.3 us on cuBLAS -> 14.2)
        plan = SplitPlan(swept(Tiles(128, 64, 128, 4, 4, _SPLIT_K_TMA)), plan.splits)
    override, count = _TILE_OVERRIDES.get(("split_k", bucket), (None, None))
    if plan is None or override is None:
        return plan
    count = count or plan.splits
    if count > 1 and k % (count * override.block_k) == 0:
        return SplitPlan(swept(override), count)
    return plan


#: Most rows whose split-K projection takes in the ``add_norm_norm`` after it when ``rlt.attention.fold``
#: is on: the program that stores a row block's last piece then normalises those rows alone (per row it
#: reads ``splits`` x 4 bytes x N of pieces through one SM — cheap for one row, a serial tail for 16).
#: Not yet measured: ``benchmarks/decode_kernels.py --shapes o_proj,down_proj`` with RLT_FOLD=1 decides.
MAX_ROWS_FOLD = 4

_FOLD_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _fold_counters(device: torch.device, count: int = 1) -> torch.Tensor:
    """At least ``count`` zeroed ticket counters for a folded launch on ``device`` (every launch leaves them
    zero, and launches on one stream never overlap, so all call sites share them; grown, never shrunk —
    a shape's first launch runs eagerly before any graph capture, so a capture never reallocates)."""
    grown = _FOLD_COUNTERS.setdefault(device, [])
    if not grown or grown[-1].numel() < count:  # the smaller ones stay alive: captured graphs may use them
        grown.append(torch.zeros(max(count, 1024), dtype=torch.int32, device=device))
    return grown[-1]


#: Shortest K range a split of the fused q/k/v or gate/up projection streams (``_tile_splits``).
MIN_TILE_SPLIT_K = 512


def _wave_excess(programs: int, sms: int) -> float:
    """Time of ``programs`` equal programs on ``sms`` SMs over the balanced time: 1.0 = whole waves."""
    return -(-programs // sms) * sms / programs


def _tile_splits(x: torch.Tensor, tiles: int, k: int, block_k: int, block_m: int, block_n: int,
                 splits: int | None = None):
    """K splits for a fused projection of ``tiles`` output tiles (``rlt.attention.fold`` on only: the last
    program of a tile finishes it, ``split_tile_sum``), its fp32 piece scratch and the ticket counters.

    The projection is weight-streaming: its time is set by the busiest SM, so the split count is the one
    (1, 2, 4 or 8, each K range >= :data:`MIN_TILE_SPLIT_K` and whole K tiles) whose programs fill the
    SMs' waves most evenly, kept only if that beats one split by more than 10 %: q/k/v at one row on
    132 SMs is 96 programs (27 % of the SMs idle) -> 4 splits, 384 programs (3 % excess); gate/up is
    176 -> 2 splits, 352 (12.5 %). Not yet measured (``docs/decode.md``). ``splits``: this count
    instead of the rule's (a tile sweep's, ``RLT_LINEAR_TILES``'; more than one needs a fold-capable device and
    whole K tiles)."""
    if splits is not None:
        if splits > 1 and not fold_capable(x.device)[0]:
            raise ValueError(f"{splits} K splits of a fused projection need a device that runs the fold's last "
                             f"program (the one that sums them): {fold_capable(x.device)[1]}")
        if splits < 1 or (splits > 1 and k % (splits * block_k)):  # one split masks its K tail
            raise ValueError(f"{splits} K splits of K={k} in tiles of {block_k}: not whole tiles")
    elif not fold_enabled(x, "tiles"):
        return 1, x, x
    best = splits or _balanced_splits(tiles, k, block_k, _sm_count(x.device), MIN_TILE_SPLIT_K)
    if best == 1:
        return 1, x, x
    parts = torch.empty(tiles * best * 2 * block_m * block_n, dtype=torch.float32, device=x.device)
    return best, parts, _fold_counters(x.device, tiles)


@functools.lru_cache(maxsize=1024)  # asked at every launch; pure in its ints
def _balanced_splits(tiles: int, k: int, block_k: int, sms: int, min_split_k: int) -> int:
    best, best_excess = 1, _wave_excess(tiles, sms)
    for splits in (2, 4, 8):
        if k % (splits * block_k) or k // splits < min_split_k:
            continue
        excess = _wave_excess(tiles * splits, sms)
        if excess < best_excess / 1.1:
            best, best_excess = splits, excess
    return best


def _launch_split_k(x: torch.Tensor, weight: torch.Tensor, plan: SplitPlan, fold: tuple | None = None) -> torch.Tensor:
    """The split-K pieces of ``x @ weight.T`` (fp32 ``[splits, M, N]``); with ``fold = (h, w1, w2, out_h,
    out_n, eps)`` the same launch also writes ``add_norm_norm(h, pieces, w1, w2, eps)`` into out_h / out_n
    (``w2`` None: no second norm)."""
    m, k = x.shape
    n = weight.shape[0]
    (bm, bn, bk, warps, stages, _), splits = plan
    parts = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    xa, wa, tma = _operands(x, weight, plan.tiles, bn)
    if fold is None:
        tail = (x, x, x, x, x, x, 0, 0, 0, 0.0)  # not read (FOLD off)
        has_second = False
    else:
        h, w1, w2, out_h, out_n, eps = fold
        has_second = w2 is not None
        tail = (_fold_counters(x.device, triton.cdiv(m, bm)), h, w1, w2 if has_second else w1, out_h, out_n, h.stride(0),
                out_h.stride(0), out_n.stride(0), eps)
    _linear_split_k_kernel[(triton.cdiv(n, bn), splits, triton.cdiv(m, bm))](
        xa, wa, parts, m, n, k // splits, x.stride(0), weight.stride(0), parts.stride(0), parts.stride(1), *tail,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=True, PRECISION=_precision(x), FOLD=fold is not None,
        SPLITS=splits, HAS_SECOND=has_second, BLOCK_ROW=triton.next_power_of_2(n), TMA=tma, num_warps=warps,
        num_stages=stages, **(_NO_PREFETCH if tma else _prefetch(x, k // splits)), **kernel_options(x))
    return parts


class _FoldedSplitK(PendingProjection):
    """``x @ weight.T`` as split-K pieces whose ``add_norm_norm`` rides in the same launch."""

    __slots__ = ("x", "weight", "plan")

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, plan: SplitPlan) -> None:
        self.x, self.weight, self.plan = x, weight, plan

    def total(self) -> torch.Tensor:
        return SplitSum(_launch_split_k(self.x, self.weight, self.plan), self.x.dtype).total()

    def add_norm_norm(self, h: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor | None, eps: float):
        out_h = torch.empty_like(h)
        out_n = torch.empty_like(h) if w2 is not None else out_h
        _launch_split_k(self.x, self.weight, self.plan, fold=(h, w1, w2, out_h, out_n, eps))
        return out_h, (out_n if w2 is not None else None)


def linear_split_k(x: torch.Tensor, weight: torch.Tensor,
                   plan: SplitPlan | None = None) -> torch.Tensor | SplitSum | PendingProjection:
    """``F.linear(x, weight)`` for decode-sized ``x``, as split-K partial sums (:class:`SplitSum`) for a
    consumer that reduces them in its own launch (:func:`~rlt.platform.models.fused_ops.add_norm_norm`);
    with ``rlt.attention.fold`` on and at most :data:`MAX_ROWS_FOLD` rows, a pending launch that
    ``add_norm_norm`` runs with its work folded in; the plain ``F.linear`` result where the kernel does
    not serve the shape."""
    if not _SPLIT_K or not small_m_usable(x, weight, MAX_ROWS_SPLIT_K):
        return F.linear(x, weight)
    m, k = x.shape
    # (the row test first: at decode sizes no TMA checks on the host)
    if plan is None and m > ROW_BUCKETS[-1] and leaves_to_cublas("split_k", m, _SPLIT_K_TMA and tma_ready(x)
                                                                  and tma_ready(weight)):
        return F.linear(x, weight)
    plan = plan or split_plan(m, weight.shape[0], k, x.element_size())
    if plan is None:
        return F.linear(x, weight)
    if m <= MAX_ROWS_FOLD and fold_enabled(x, "split_k"):
        return _FoldedSplitK(x, weight, plan)
    return SplitSum(_launch_split_k(x, weight, plan), x.dtype)


def linear_silu_mul(x: torch.Tensor, gate_up: torch.Tensor, tiles: Tiles | None = None,
                    splits: int | None = None) -> torch.Tensor:
    """``silu(g) * u`` with ``[g | u] = F.linear(x, gate_up)`` (``gate_up = [G; U]``, ``[2I, K]``).
    ``tiles`` / ``splits``: a launch shape instead of the defaults (tile sweeps, :func:`_tile_splits`;
    without them ``RLT_LINEAR_TILES`` may set it)."""
    if not small_m_usable(x, gate_up, MAX_ROWS_SILU_MUL):
        return silu_mul(F.linear(x, gate_up))
    m, k = x.shape
    ready = tma_ready(x) and tma_ready(gate_up)
    if tiles is None and leaves_to_cublas("silu_mul", m, ready):
        return silu_mul(F.linear(x, gate_up))
    inter = gate_up.shape[0] // 2
    out = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    tiles, splits = _launch_shape(m, "silu_mul", tiles, splits, ready)
    tiles = _fit(tiles, k, x.element_size())
    bm, bn, bk, warps, stages, _ = tiles
    tiles_n, tiles_m = triton.cdiv(inter, bn), triton.cdiv(m, bm)
    splits, parts, counters = _tile_splits(x, tiles_n * tiles_m, k, bk, bm, bn, splits)
    xa, wa, tma = _operands(x, gate_up, tiles, bn, ready)
    _linear_silu_mul_kernel[(tiles_n, tiles_m, splits)](
        xa, wa, out, parts, counters, m, inter, k, x.stride(0), gate_up.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=(k // splits) % bk == 0, PRECISION=_precision(x),
        ACCURATE_EXP=not _interpreting(), SPLITS=splits, TMA=tma, num_warps=warps, num_stages=stages,
        **(_NO_PREFETCH if tma else _prefetch(x, k // splits)), **kernel_options(x))
    return out


def _operands(x: torch.Tensor, w: torch.Tensor, tiles: Tiles, box_n: int, ready: bool | None = None) -> tuple:
    """``(x, w, False)``, or with ``tiles.tma`` where both tensors allow it (``tma_ready``; ``ready``: the
    caller already asked) their TMA descriptors — boxes of ``block_m`` x ``block_k`` and ``box_n`` x
    ``block_k`` — and True. Built per launch (a few host microseconds; a captured graph keeps them): a cache
    keyed by pointer would keep freed weights alive."""
    if ready is None:
        ready = tma_ready(x) and tma_ready(w)
    if not (tiles.tma and ready):
        return x, w, False
    return tma_descriptor(x, [tiles.block_m, tiles.block_k]), tma_descriptor(w, [box_n, tiles.block_k]), True


def linear_rope_kv(x: torch.Tensor, qkv_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   num_q_heads: int, num_kv_heads: int, head_dim: int,
                   kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                   tiles: Tiles | None = None, splits: int | None = None):
    """q/k/v projection with split-half RoPE on q and k: returns views ``q, k, v`` and whether the
    kernel already stored k and v into ``kv_store = (k_cache_layer, v_cache_layer, slot_mapping)``
    (flat slot rows; slots < 0 are skipped). When it returns False the caller writes the KV.
    ``tiles`` / ``splits``: a launch shape instead of the defaults (tile sweeps, :func:`_tile_splits`)."""
    half = head_dim // 2
    fusable = small_m_usable(x, qkv_weight, MAX_ROWS_ROPE_KV) and head_dim % 2 == 0 and half >= 16 and (half & (half - 1)) == 0
    if not fusable:  # prompt-sized rows: cuBLAS projection, then RoPE + KV store in one launch
        return rope_qk_(F.linear(x, qkv_weight), cos, sin, num_q_heads, num_kv_heads, head_dim, kv_store=kv_store)
    m, kdim = x.shape
    heads = num_q_heads + 2 * num_kv_heads
    out = torch.empty((m, heads * head_dim), dtype=x.dtype, device=x.device)
    ready = tma_ready(x) and tma_ready(qkv_weight)
    tiles, splits = _launch_shape(m, "rope_kv", tiles, splits, ready)
    tiles = _fit(tiles, kdim, x.element_size())
    bm, bn, bk, warps, stages, _ = tiles
    bn = min(bn, half)
    write = kv_store is not None and cos.stride(-1) == 1 and sin.stride(0) == cos.stride(0)
    k_cache, v_cache, slots = kv_store if write else (out, out, out)
    tiles_n, tiles_m = heads * (half // bn), triton.cdiv(m, bm)
    splits, parts, counters = _tile_splits(x, tiles_n * tiles_m, kdim, bk, bm, bn, splits)
    xa, wa, tma = _operands(x, qkv_weight, tiles, bn, ready)
    _linear_rope_kv_kernel[(tiles_n, tiles_m, splits)](
        xa, wa, out, cos, sin, k_cache, v_cache, slots, parts, counters,
        m, kdim, x.stride(0), qkv_weight.stride(0), out.stride(0), cos.stride(0),
        NUM_Q=num_q_heads, NUM_KV=num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        EVEN_K=(kdim // splits) % bk == 0, PRECISION=_precision(x), WRITE_KV=write, SPLITS=splits, TMA=tma,
        num_warps=warps, num_stages=stages, **(_NO_PREFETCH if tma else _prefetch(x, kdim // splits)),
        **kernel_options(x))
    qd, kd = num_q_heads * head_dim, num_kv_heads * head_dim
    q = out[:, :qd].view(m, num_q_heads, head_dim)
    k = out[:, qd:qd + kd].view(m, num_kv_heads, head_dim)
    v = out[:, qd + kd:].view(m, num_kv_heads, head_dim)
    return q, k, v, write
