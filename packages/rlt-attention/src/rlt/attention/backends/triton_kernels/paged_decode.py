"""Paged decode attention: one query token per row, flash-decoding over depth-resolved pages.

Grid ``(rows, head_programs, num_splits)`` — or ``(head_programs, rows, num_splits)`` with ``HEADS_FASTEST``, so
the programs the hardware hands out together are the head programs of a few rows, reading the same pages (NHD:
one token's heads are one contiguous stripe) at about the same time; the split count is a run-time argument (only "split
or not" is compiled in), so a new batch size never triggers a new compile. Each program walks its share of the row's key tiles
(``cdiv(tiles, num_splits)`` consecutive tiles) with an online softmax in fp32 (exp2 domain).
With one split it normalises and writes the output row; with several it writes the unnormalised
partial ``acc`` and its ``(max, sum)`` to preallocated fp32 scratch and :func:`merge_splits_kernel`
combines them (``out = Σ acc_s 2^(m_s - M) / Σ l_s 2^(m_s - M)``) — or, with ``FOLD``, the program
that stores a row's last partial combines them itself (``rlt.attention.fold``: same sums, same order,
no merge launch; ``cnt_ptr`` holds one zeroed ticket counter per row and head program). Rows whose query length is not
1 are skipped (a mixed batch sends them to the prefill kernel), so the grid depends only on the
number of rows, never on device data.

Two score paths:

* :func:`decode_kernel` — one query head per program, scores by broadcast-multiply + row sum
  (no MMA: an MHA decode row has a single query, and ``tl.dot`` needs M >= 16). For GQA the
  group's heads each re-read their KV head (served from L2).
* :func:`decode_grouped_kernel` — one KV head per program with all ``GROUP`` query heads packed
  into the M dimension of ``tl.dot`` (padded to 16), so each KV tile is read once per group.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rlt.attention.backends.triton_kernels.paging import STEP_VARYING, key_offsets
from rlt.attention.backends.triton_kernels.fold import last_arrival, reset_counter
from rlt.attention.backends.triton_kernels.pdl import dependent_wait, launch_dependents


@triton.jit
def _row_and_head(HEADS_FASTEST: tl.constexpr):
    """This program's (row, head program) for the grid order ``HEADS_FASTEST`` chose."""
    if HEADS_FASTEST:
        return tl.program_id(1), tl.program_id(0)
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _split_range(seq_len, split, num_splits, BLOCK_N: tl.constexpr):
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(num_tiles, num_splits)
    begin = split * per_split
    end = tl.minimum(begin + per_split, num_tiles)
    return begin, end


@triton.jit
def _merge_head(out_ptr, part_acc_ptr, part_ml_ptr, q_start, row, head, stride_on, num_splits,
                NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                CACHE: tl.constexpr, PDL: tl.constexpr):
    """Combine the ``num_splits`` partials of (row, head) into its output row (``CACHE`` ".cg" when other
    programs of the running kernel wrote them: read from L2)."""
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    part = (row * NUM_HEADS + head) * num_splits + offs_s
    m = tl.load(part_ml_ptr + part * 2, mask=mask_s, other=-1.0e30, cache_modifier=CACHE)
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=mask_s, other=0.0, cache_modifier=CACHE)
    acc = tl.load(part_acc_ptr + part.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=mask_s[:, None] & mask_d[None, :], other=0.0, cache_modifier=CACHE)
    launch_dependents(PDL)
    w = tl.exp2(m - tl.max(m, 0))
    den = tl.sum(l * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + q_start.to(tl.int64) * stride_on + head * HEAD_DIM + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=mask_d)


@triton.jit(do_not_specialize=STEP_VARYING)
def decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr, cnt_ptr,
    bt_ptr, td_ptr, slots_ptr, seq_lens_ptr, qdepth_ptr, qsl_ptr,
    sm_scale_log2,
    stride_qn, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_on,
    stride_btr, stride_btp, stride_sr,
    num_planes, num_splits,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    LAST_EXITED: tl.constexpr,
    PRE_RESOLVED: tl.constexpr,
    FOLD: tl.constexpr = False,
    BLOCK_S: tl.constexpr = 64,
    PDL: tl.constexpr = False,
    HEADS_FASTEST: tl.constexpr = False,
):
    dependent_wait(PDL)
    row, head = _row_and_head(HEADS_FASTEST)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + row)
    q_len = tl.load(qsl_ptr + row + 1) - q_start
    if q_len != 1:
        return
    seq_len = tl.load(seq_lens_ptr + row)
    qd = tl.load(qdepth_ptr + row)
    kv_head = head // GROUP

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(q_ptr + q_start.to(tl.int64) * stride_qn + head * stride_qh + offs_d, mask=mask_d, other=0.0)
    q = q.to(tl.float32) * sm_scale_log2

    bt_row = bt_ptr + row.to(tl.int64) * stride_btr
    slots_row = slots_ptr + row.to(tl.int64) * stride_sr
    begin, end = _split_range(seq_len, split, num_splits, BLOCK_N)
    m_i = -1.0e30
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    # The block ids of tile t+1 are fetched while tile t's K/V loads are in flight: Triton does
    # not software-pipeline this (non-dot) loop, and the id lookup is a chain of 3 dependent loads.
    offs_n = begin * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < tl.minimum(end * BLOCK_N, seq_len)
    kv_off = key_offsets(bt_row, td_ptr, slots_row, offs_n, mask_n, qd, stride_btp, num_planes, stride_kb,
                         stride_ks, BLOCK_SIZE, LAST_EXITED, PRE_RESOLVED)
    for t in range(begin, end):
        mask_kv = mask_n[:, None] & mask_d[None, :]
        ptrs = kv_off[:, None] + kv_head * stride_kh + offs_d[None, :]
        k = tl.load(k_ptr + ptrs, mask=mask_kv, other=0.0)
        v = tl.load(v_ptr + ptrs, mask=mask_kv, other=0.0)
        next_offs = offs_n + BLOCK_N
        next_mask = next_offs < tl.minimum(end * BLOCK_N, seq_len)
        next_kv_off = key_offsets(bt_row, td_ptr, slots_row, next_offs, next_mask, qd, stride_btp, num_planes,
                                  stride_kb, stride_ks, BLOCK_SIZE, LAST_EXITED, PRE_RESOLVED)
        s = tl.sum(k.to(tl.float32) * q[None, :], 1)
        s = tl.where(mask_n, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
        offs_n, mask_n, kv_off = next_offs, next_mask, next_kv_off

    launch_dependents(PDL)
    if not SPLIT:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)
        tl.store(out_ptr + q_start.to(tl.int64) * stride_on + head * HEAD_DIM + offs_d,
                 out.to(out_ptr.dtype.element_ty), mask=mask_d)
    else:
        part = (row * NUM_HEADS + head) * num_splits + split
        tl.store(part_acc_ptr + part.to(tl.int64) * HEAD_DIM + offs_d, acc, mask=mask_d)
        tl.store(part_ml_ptr + part * 2, m_i)
        tl.store(part_ml_ptr + part * 2 + 1, l_i)
        if FOLD:
            counter = cnt_ptr + row * NUM_HEADS + head
            if last_arrival(counter, num_splits):
                _merge_head(out_ptr, part_acc_ptr, part_ml_ptr, q_start, row, head, stride_on, num_splits,
                            NUM_HEADS, HEAD_DIM, BLOCK_D, BLOCK_S, ".cg", False)
                reset_counter(counter)


@triton.jit(do_not_specialize=STEP_VARYING)
def decode_grouped_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr, cnt_ptr,
    bt_ptr, td_ptr, slots_ptr, seq_lens_ptr, qdepth_ptr, qsl_ptr,
    sm_scale_log2,
    stride_qn, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_on,
    stride_btr, stride_btp, stride_sr,
    num_planes, num_splits,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    LAST_EXITED: tl.constexpr,
    PRE_RESOLVED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FOLD: tl.constexpr = False,
    BLOCK_S: tl.constexpr = 64,
    PDL: tl.constexpr = False,
    HEADS_FASTEST: tl.constexpr = False,
):
    dependent_wait(PDL)
    row, kv_head = _row_and_head(HEADS_FASTEST)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + row)
    q_len = tl.load(qsl_ptr + row + 1) - q_start
    if q_len != 1:
        return
    seq_len = tl.load(seq_lens_ptr + row)
    qd = tl.load(qdepth_ptr + row)

    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(q_ptr + q_start.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)

    bt_row = bt_ptr + row.to(tl.int64) * stride_btr
    slots_row = slots_ptr + row.to(tl.int64) * stride_sr
    begin, end = _split_range(seq_len, split, num_splits, BLOCK_N)
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for t in range(begin, end):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < seq_len
        kv_off = key_offsets(bt_row, td_ptr, slots_row, offs_n, mask_n, qd, stride_btp, num_planes, stride_kb,
                             stride_ks, BLOCK_SIZE, LAST_EXITED, PRE_RESOLVED)
        mask_kv = mask_n[:, None] & mask_d[None, :]
        ptrs = kv_off[:, None] + kv_head * stride_kh + offs_d[None, :]
        k = tl.load(k_ptr + ptrs, mask=mask_kv, other=0.0)
        v = tl.load(v_ptr + ptrs, mask=mask_kv, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    launch_dependents(PDL)
    if not SPLIT:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_start.to(tl.int64) * stride_on + heads[:, None] * HEAD_DIM + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
    else:
        part = (row * NUM_HEADS + heads) * num_splits + split
        tl.store(part_acc_ptr + part.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=mask_g[:, None] & mask_d[None, :])
        tl.store(part_ml_ptr + part * 2, m_i, mask=mask_g)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=mask_g)
        if FOLD:
            counter = cnt_ptr + row * NUM_HEADS + kv_head * GROUP
            if last_arrival(counter, num_splits):
                for g in range(GROUP):
                    _merge_head(out_ptr, part_acc_ptr, part_ml_ptr, q_start, row, kv_head * GROUP + g, stride_on,
                                num_splits, NUM_HEADS, HEAD_DIM, BLOCK_D, BLOCK_S, ".cg", False)
                reset_counter(counter)


@triton.jit(do_not_specialize=["num_splits"])
def merge_splits_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, qsl_ptr,
    stride_on, num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,
):
    dependent_wait(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + row)
    q_len = tl.load(qsl_ptr + row + 1) - q_start
    if q_len != 1:
        return
    _merge_head(out_ptr, part_acc_ptr, part_ml_ptr, q_start, row, head, stride_on, num_splits,
                NUM_HEADS, HEAD_DIM, BLOCK_D, BLOCK_S, "", PDL)
