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

With ``SKIP_SINGLE`` rows of query length 1 are left to the decode kernel (mixed batches).
"""

from __future__ import annotations

import triton
import triton.language as tl

from rlt.attention.backends.triton_kernels.paging import find_row, key_offsets


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, start, k_ptr, v_ptr, bt_row, td_ptr, slots_row, qd, stride_btp, num_planes,
    stride_kb, stride_ks, head_off, offs_d, mask_d, q_pos, kv_end,
    sm_scale_log2,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr,
    LAST_EXITED: tl.constexpr, PRE_RESOLVED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    offs_n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        mask_n = offs_n < kv_end
    else:
        mask_n = offs_n >= 0
    kv_off = key_offsets(bt_row, td_ptr, slots_row, offs_n, mask_n, qd, stride_btp, num_planes, stride_kb, stride_ks,
                         BLOCK_SIZE, LAST_EXITED, PRE_RESOLVED) + head_off
    k_ptrs = k_ptr + kv_off[None, :] + offs_d[:, None]
    v_ptrs = v_ptr + kv_off[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=mask_d[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=mask_d[None, :], other=0.0)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * sm_scale_log2
    if MASKED:
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
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
):
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    row = find_row(qsl_ptr, q_block, num_rows, BLOCK_Q)
    q_start = tl.load(qsl_ptr + row)
    q_len = tl.load(qsl_ptr + row + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + row)
    if local * BLOCK_Q >= q_len:
        return
    if SKIP_SINGLE:
        if q_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + row)
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
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, start, k_ptr, v_ptr, bt_row, td_ptr, slots_row, qd, stride_btp, num_planes,
            stride_kb, stride_ks, head_off, offs_d, mask_d, q_pos, kv_end, sm_scale_log2,
            BLOCK_SIZE, BLOCK_N, BLOCK_D == HEAD_DIM, False, LAST_EXITED, PRE_RESOLVED, DOT_PRECISION)
    for start in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, start, k_ptr, v_ptr, bt_row, td_ptr, slots_row, qd, stride_btp, num_planes,
            stride_kb, stride_ks, head_off, offs_d, mask_d, q_pos, kv_end, sm_scale_log2,
            BLOCK_SIZE, BLOCK_N, BLOCK_D == HEAD_DIM, True, LAST_EXITED, PRE_RESOLVED, DOT_PRECISION)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_on + head[:, None] * HEAD_DIM + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
