"""Causal attention of fresh prompt rows over their own new keys, read densely through TMA descriptors.

A row whose context is exactly its new tokens (``seq_len == q_len``: a prompt's first chunk with no
cached prefix) attends only to keys computed in this very step — at the query's own depth, under either
KV layout — and those keys are also in the step's dense k / v projection output, the tensors the KV
store copies into the pages. Reading them from there instead of from 16-token pages makes every K/V
tile one contiguous 2-D box, so it can be loaded by TMA (``tl`` tensor descriptors built on the host),
which the paged kernel cannot use (sm_90 TMA has no gather; ``paged_prefill``'s docstring). Same
online softmax as ``paged_prefill`` (``_softmax_pv``, one key loop, the causal mask on the diagonal
tiles only), so results differ from the paged kernel only by the fp32 summation order of the tiles.

Grid ``(query heads, num_tokens // BLOCK_M + rows)``, heads fastest, longest query blocks first; a
program serves ``BLOCK_M`` queries of one head (GQA: each query head re-reads its KV head's tiles, from
L2). Rows that are not fresh (or of query length 1, with ``SKIP_SINGLE``) are left to the paged kernels,
which skip the fresh ones (``paged_prefill.prefill_kernel``'s ``SKIP_FRESH``). Boxes that run past a
row read the next row's tokens (masked out) or zeros past the tensor's end (TMA's out-of-bounds fill).
"""

from __future__ import annotations

import triton
import triton.language as tl

from rlt.attention.backends.triton_kernels.paged_prefill import _softmax_pv
from rlt.attention.backends.triton_kernels.paging import query_block


@triton.jit(do_not_specialize=["num_rows", "stride_on"])
def dense_prefill_kernel(
    q_desc, k_desc, v_desc, out_ptr, seq_lens_ptr, qsl_ptr, sm_scale_log2, stride_on, num_rows,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SKIP_SINGLE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FMA_SCALE: tl.constexpr = True,
    DOT_ACC: tl.constexpr = True,
    LAZY_RESCALE: tl.constexpr = False,
):
    head = tl.program_id(0)
    q_block = tl.num_programs(1) - 1 - tl.program_id(1)
    row, q_start, q_len, local = query_block(qsl_ptr, q_block, num_rows, BLOCK_M)
    if local * BLOCK_M >= q_len:
        return
    if SKIP_SINGLE:
        if q_len == 1:
            return
    if tl.load(seq_lens_ptr + row) != q_len:  # keys before this step: the paged kernel's row
        return
    kv_col = (head // GROUP) * HEAD_DIM
    first = local * BLOCK_M
    q = q_desc.load([q_start + first, head * HEAD_DIM])
    q_pos = first + tl.arange(0, BLOCK_M)
    kv_end = tl.minimum(first + BLOCK_M, q_len)
    full_end = ((first + 1) // BLOCK_N) * BLOCK_N  # tiles below it lie wholly at or before every query

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start in range(0, kv_end, BLOCK_N):
        k = k_desc.load([q_start + start, kv_col])
        v = v_desc.load([q_start + start, kv_col])
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        offs_n = start + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = _softmax_pv(acc, m_i, l_i, s, v, start, full_end, offs_n, offs_n < kv_end, q_pos,
                                    sm_scale_log2, 2, DOT_PRECISION, FMA_SCALE, DOT_ACC, LAZY_RESCALE)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    rows = (q_start + q_pos).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + rows[:, None] * stride_on + head * HEAD_DIM + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(q_pos < q_len)[:, None])
