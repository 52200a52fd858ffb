"""Ragged multi-token causal attention over depth-resolved paged KV (prefill chunks).

Grid ``(num_tokens // BLOCK_Q + rows, kv_heads)``: row r owns query blocks starting at
``query_start_loc[r] // BLOCK_Q + r`` (see :func:`find_row`), so the grid is a static upper bound
and surplus programs exit. Blocks are visited longest-first (program 0 takes the last block) so
the causal tail does not straggle. A program holds ``BLOCK_Q`` query tokens x ``GROUP_PAD`` query
heads of one KV head in the M dimension (GQA packing: each KV tile is read once per group).

Queries are bottom-right aligned: token i of a row with q new tokens and context c sits at
position ``c - q + i``. Key tiles entirely at or below the block's first query position need no
mask (first loop); the remaining tiles up to the block's last query position are masked
(second loop). Softmax is online, fp32, in the exp2 domain; P is cast to the value dtype for the
PV product (bf16/fp16 MMA with fp32 accumulation; fp32 inputs use ``DOT_PRECISION``).

With ``SKIP_SINGLE`` rows of query length 1 are left to the decode kernel (mixed batches); with
``SKIP_FRESH`` rows whose context is only their new tokens are left to ``dense_prefill``.

Variants (constexpr switches, all exact up to fp32 summation order; :class:`PrefillTiles` of the
backend sets them, ``benchmarks/prefill_kernel_sweep.py`` times them):

- ``HEADS_FASTEST``: grid ``(kv_heads, blocks)`` instead of ``(blocks, kv_heads)``. The hardware
  hands out programs in launch order, so with heads fastest the longest query blocks of *every*
  head go first (longest-processing-time order over the whole grid); with blocks fastest only each
  head's blocks are ordered, and the last head's longest blocks start near the end (a tail).
- ``K_NATURAL``: load K tiles as ``[BLOCK_N, D]`` (a key's head_dim contiguous along the fast
  axis, as the cache stores it) and feed ``tl.trans(k)`` to the dot, instead of a ``[D, BLOCK_N]``
  gather.
- ``FMA_SCALE``: fold the softmax scale into the exponent (``exp2(s * c - m)``, one FMA per score)
  and take the running max of ``max(s) * c``, instead of scaling the score tile first.
- ``DOT_ACC``: accumulate PV into the rescaled accumulator inside the MMA (``tl.dot(p, v, acc)``).
- ``LAZY_RESCALE``: rescale ``acc`` and ``l`` only when some row's max grew by more than
  ``RESCALE_LOG2`` (8: P values stay <= 256, safe in bf16/fp16 and fp32) since the last rescale
  (FlashAttention-4's conditional rescaling); otherwise keep the stale max, which cancels in
  ``acc / l``.
- ``ONE_LOOP``: one key loop over all tiles, the causal mask applied (a run-time branch) only to
  tiles past ``full_end``, instead of an unmasked and a masked loop. With two loops ptxas (CUDA
  13, sm_90a) reports C7515 "wgmma.mma_async instructions are serialized due to non wgmma
  instructions defining accumulator registers" and waits after every 16-wide HGMMA of the
  whole kernel (the accumulators cross from one loop into the other); with one loop the QK and
  PV HGMMA chains issue back to back with one wait each, and PV stays in flight into the next
  tile (``benchmarks/triton_aot_report.py``-style compile for sm_90, no GPU needed).

Tried and not kept (sm_90 SASS shows they cannot help): Triton's ``warp_specialize`` loop
attribute (identical SASS for these gathered, non-TMA loads), and computing tile j+1's scores
before tile j's softmax as loop-carried values (FlashAttention-3's intra-warpgroup overlap):
Triton waits on that QK^T right after issuing it, so nothing overlaps. TMA cannot load the tiles
either: a page holds 16 tokens, so a 64/128-key tile is 4-8 pages at unrelated addresses, and
sm_90 TMA has no gather (one descriptor load per page would need the pages re-assembled in
shared memory before the MMA).
"""

from __future__ import annotations

import triton
import triton.language as tl

from rlt.attention.backends.triton_kernels.paging import STEP_VARYING, key_offsets, query_block

#: LAZY_RESCALE threshold in the log2 domain: P values stay <= 2**8 between rescales.
RESCALE_LOG2 = tl.constexpr(8.0)


@triton.jit
def _tile_kv(
    start, k_ptr, v_ptr, bt_row, td_ptr, slots_row, qd, stride_btp, num_planes, stride_kb, stride_ks, head_off,
    offs_d, mask_d, kv_end,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr,
    LAST_EXITED: tl.constexpr, PRE_RESOLVED: tl.constexpr, K_NATURAL: tl.constexpr,
):
    """Key positions, their validity and the K and V tiles of the keys ``start .. start + BLOCK_N``.
    MASKED: 0 = a tile wholly below the block's first query (no bounds mask), else bounded by ``kv_end``."""
    offs_n = start + tl.arange(0, BLOCK_N)
    if MASKED != 0:
        mask_n = offs_n < kv_end
    else:
        mask_n = offs_n >= 0
    kv_off = key_offsets(bt_row, td_ptr, slots_row, offs_n, mask_n, qd, stride_btp, num_planes, stride_kb, stride_ks,
                         BLOCK_SIZE, LAST_EXITED, PRE_RESOLVED) + head_off
    if K_NATURAL:
        k_ptrs = k_ptr + kv_off[:, None] + offs_d[None, :]
        k_mask = mask_n[:, None] & mask_d[None, :]
        k_dmask = mask_d[None, :]
    else:
        k_ptrs = k_ptr + kv_off[None, :] + offs_d[:, None]
        k_mask = mask_n[None, :] & mask_d[:, None]
        k_dmask = mask_d[:, None]
    v_ptrs = v_ptr + kv_off[:, None] + offs_d[None, :]
    if MASKED != 0:
        k = tl.load(k_ptrs, mask=k_mask, other=0.0)
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=k_dmask, other=0.0)
        v = tl.load(v_ptrs, mask=mask_d[None, :], other=0.0)
    return offs_n, mask_n, k, v


@triton.jit
def _scores(q, k, K_NATURAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    if K_NATURAL:
        return tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    else:
        return tl.dot(q, k, input_precision=DOT_PRECISION)


@triton.jit
def _softmax_pv(
    acc, m_i, l_i, s, v, start, full_end, offs_n, mask_n, q_pos, sm_scale_log2,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, FMA_SCALE: tl.constexpr, DOT_ACC: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
):
    """Online softmax of one score tile and its PV product. MASKED: 0 = no mask, 1 = causal + bounds
    mask, 2 = the mask only when ``start >= full_end`` (decided at run time)."""
    if MASKED == 1:
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :], s, float("-inf"))
    elif MASKED == 2:
        if start >= full_end:
            s = tl.where((offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :], s, float("-inf"))
    if FMA_SCALE:
        m_tile = tl.max(s, 1) * sm_scale_log2
    else:
        s = s * sm_scale_log2
        m_tile = tl.max(s, 1)
    if LAZY_RESCALE:
        # Rescale only when some row's max grew by more than RESCALE_LOG2 since the last rescale.
        if tl.max(m_tile - m_i, 0) > RESCALE_LOG2:
            m_new = tl.maximum(m_i, m_tile)
            alpha = tl.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        if FMA_SCALE:
            p = tl.exp2(s * sm_scale_log2 - m_i[:, None])
        else:
            p = tl.exp2(s - m_i[:, None])
        l_i = l_i + tl.sum(p, 1)
        if DOT_ACC:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        else:
            acc = acc + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    else:
        m_new = tl.maximum(m_i, m_tile)
        alpha = tl.exp2(m_i - m_new)
        if FMA_SCALE:
            p = tl.exp2(s * sm_scale_log2 - m_new[:, None])
        else:
            p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_ACC:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, start, k_ptr, v_ptr, bt_row, td_ptr, slots_row, qd, stride_btp, num_planes,
    stride_kb, stride_ks, head_off, offs_d, mask_d, q_pos, kv_end, full_end,
    sm_scale_log2,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr,
    LAST_EXITED: tl.constexpr, PRE_RESOLVED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    K_NATURAL: tl.constexpr = False, FMA_SCALE: tl.constexpr = False, DOT_ACC: tl.constexpr = False,
    LAZY_RESCALE: tl.constexpr = False,
):
    offs_n, mask_n, k, v = _tile_kv(
        start, k_ptr, v_ptr, bt_row, td_ptr, slots_row, qd, stride_btp, num_planes, stride_kb, stride_ks, head_off,
        offs_d, mask_d, kv_end, BLOCK_SIZE, BLOCK_N, EVEN_D, MASKED, LAST_EXITED, PRE_RESOLVED, K_NATURAL)
    s = _scores(q, k, K_NATURAL, DOT_PRECISION)
    return _softmax_pv(acc, m_i, l_i, s, v, start, full_end, offs_n, mask_n, q_pos, sm_scale_log2,
                       MASKED, DOT_PRECISION, FMA_SCALE, DOT_ACC, LAZY_RESCALE)


@triton.jit(do_not_specialize=STEP_VARYING)
def prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    bt_ptr, td_ptr, slots_ptr, seq_lens_ptr, qdepth_ptr, qsl_ptr,
    sm_scale_log2,
    stride_qn, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_on,
    stride_btr, stride_btp, stride_sr,
    num_rows, num_planes,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LAST_EXITED: tl.constexpr,
    SKIP_SINGLE: tl.constexpr,
    PRE_RESOLVED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEADS_FASTEST: tl.constexpr = False,
    K_NATURAL: tl.constexpr = False,
    FMA_SCALE: tl.constexpr = False,
    DOT_ACC: tl.constexpr = False,
    LAZY_RESCALE: tl.constexpr = False,
    ONE_LOOP: tl.constexpr = False,
    SKIP_FRESH: tl.constexpr = False,
):
    if HEADS_FASTEST:
        q_block = tl.num_programs(1) - 1 - tl.program_id(1)
        kv_head = tl.program_id(0)
    else:
        q_block = tl.num_programs(0) - 1 - tl.program_id(0)
        kv_head = tl.program_id(1)
    row, q_start, q_len, local = query_block(qsl_ptr, q_block, num_rows, BLOCK_Q)
    if local * BLOCK_Q >= q_len:
        return
    if SKIP_SINGLE:
        if q_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + row)
    if SKIP_FRESH:  # rows with no earlier context: dense_prefill serves them
        if seq_len == q_len:
            return
    qd = tl.load(qdepth_ptr + row)
    ctx_start = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    tok = local * BLOCK_Q + offs_m // GROUP_PAD
    g = offs_m % GROUP_PAD
    mask_m = (tok < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    q_pos = ctx_start + tok

    first_pos = ctx_start + local * BLOCK_Q
    kv_end = tl.minimum(ctx_start + (local + 1) * BLOCK_Q, seq_len)
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    bt_row = bt_ptr + row.to(tl.int64) * stride_btr
    slots_row = slots_ptr + row.to(tl.int64) * stride_sr
    head_off = kv_head * stride_kh

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if ONE_LOOP:
        for start in range(0, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, start, k_ptr, v_ptr, bt_row, td_ptr, slots_row, qd, stride_btp, num_planes,
                stride_kb, stride_ks, head_off, offs_d, mask_d, q_pos, kv_end, full_end, sm_scale_log2,
                BLOCK_SIZE, BLOCK_N, BLOCK_D == HEAD_DIM, 2, LAST_EXITED, PRE_RESOLVED, DOT_PRECISION,
                K_NATURAL, FMA_SCALE, DOT_ACC, LAZY_RESCALE)
    else:
        for start in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, start, k_ptr, v_ptr, bt_row, td_ptr, slots_row, qd, stride_btp, num_planes,
                stride_kb, stride_ks, head_off, offs_d, mask_d, q_pos, kv_end, full_end, sm_scale_log2,
                BLOCK_SIZE, BLOCK_N, BLOCK_D == HEAD_DIM, 0, LAST_EXITED, PRE_RESOLVED, DOT_PRECISION,
                K_NATURAL, FMA_SCALE, DOT_ACC, LAZY_RESCALE)
        for start in range(full_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, start, k_ptr, v_ptr, bt_row, td_ptr, slots_row, qd, stride_btp, num_planes,
                stride_kb, stride_ks, head_off, offs_d, mask_d, q_pos, kv_end, full_end, sm_scale_log2,
                BLOCK_SIZE, BLOCK_N, BLOCK_D == HEAD_DIM, 1, LAST_EXITED, PRE_RESOLVED, DOT_PRECISION,
                K_NATURAL, FMA_SCALE, DOT_ACC, LAZY_RESCALE)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_on + head[:, None] * HEAD_DIM + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
