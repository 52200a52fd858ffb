"""Paged, depth-resolved KV addressing shared by the attention kernels.

Key position ``j`` of a row lives on page ``j // BLOCK_SIZE`` at offset ``j % BLOCK_SIZE``. Its plane
is ``min(query_depth, token_depth[plane-0 block, offset])`` under LAST_EXITED (the token's KV is
read from the deepest plane it reached, never deeper than the query), and plane 0 under SHARED.
The physical block is then ``block_tables[row, plane, page]``. This is the in-kernel form of
``rlt.attention.gather.key_slots``; no page is ever copied.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Integer arguments of the attention kernels that change from step to step: the block-table and
#: resolved-slot row strides follow the step's longest context, and the row and split counts its
#: batch. Triton would otherwise compile a new specialisation whenever one of them becomes 1 or a
#: multiple of 16 (0.3-2 s each, mid-serving: on the H200 four such compiles in a 15 s window put
#: decode ITL p99 at 1.2-3.6 s, ``benchmarks/results/h200-20261204-lease5``). Unspecialised, only
#: the constexpr variants compile, which the engine warm-up covers. (Names absent from a kernel
#: are ignored by Triton.)
STEP_VARYING = ["stride_btr", "stride_btp", "stride_sr", "num_rows", "num_splits"]


@triton.jit
def resolve_blocks(
    bt_row_ptr,  # block_tables[row] base (int32), page stride 1, plane stride ``stride_btp``
    td_ptr,  # token_depth [num_blocks * BLOCK_SIZE] int32 (unused for SHARED)
    offs_n,  # [BLOCK_N] key positions
    mask_n,  # [BLOCK_N] which positions are real (others read page 0, harmlessly)
    query_depth,  # scalar int32: the row's depth
    stride_btp,
    num_planes,
    BLOCK_SIZE: tl.constexpr,
    LAST_EXITED: tl.constexpr,
):
    """Physical block (int64) and in-block offset of every key position in ``offs_n``."""
    page = offs_n // BLOCK_SIZE
    slot = offs_n % BLOCK_SIZE
    block0 = tl.load(bt_row_ptr + page, mask=mask_n, other=0)
    if LAST_EXITED:
        stamped = tl.load(td_ptr + block0.to(tl.int64) * BLOCK_SIZE + slot, mask=mask_n, other=0)
        plane = tl.minimum(stamped, query_depth)
        plane = tl.maximum(tl.minimum(plane, num_planes - 1), 0)
        block = tl.load(bt_row_ptr + plane * stride_btp + page, mask=mask_n, other=0)
    else:
        block = block0
    return block.to(tl.int64), slot


@triton.jit
def find_row(qsl_ptr, q_block, num_rows, BLOCK_Q: tl.constexpr):
    """Row owning query block ``q_block`` when row r's blocks start at ``qsl[r] // BLOCK_Q + r``.

    That numbering gives every row at least ``cdiv(query_len, BLOCK_Q)`` block ids, and the total
    ``num_tokens // BLOCK_Q + num_rows`` is a static upper bound, so the grid needs no host sync.
    """
    lo: tl.int32 = 0
    hi = num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def query_block(qsl_ptr, q_block, num_rows, BLOCK_Q: tl.constexpr):
    """``(row, q_start, q_len, local)`` of packed query block ``q_block``: its row (:func:`find_row`), the
    row's first token and query length, and the block's index within the row (the caller returns when
    ``local * BLOCK_Q >= q_len``: a surplus block of the static grid)."""
    row = find_row(qsl_ptr, q_block, num_rows, BLOCK_Q)
    q_start = tl.load(qsl_ptr + row)
    q_len = tl.load(qsl_ptr + row + 1) - q_start
    return row, q_start, q_len, q_block - (q_start // BLOCK_Q + row)


@triton.jit
def key_offsets(
    bt_row_ptr, td_ptr, slots_row_ptr, offs_n, mask_n, query_depth, stride_btp, num_planes,
    stride_kb, stride_ks,
    BLOCK_SIZE: tl.constexpr, LAST_EXITED: tl.constexpr, PRE_RESOLVED: tl.constexpr,
):
    """int64 element offset of each key's slot in a ``[blocks, block_size, kv_heads, d]`` cache.

    ``PRE_RESOLVED``: one load from the row's slot list written by :func:`resolve_slots_kernel`
    (requires ``stride_kb == BLOCK_SIZE * stride_ks``); otherwise the 1-3 dependent table loads.
    """
    if PRE_RESOLVED:
        slot = tl.load(slots_row_ptr + offs_n, mask=mask_n, other=0)
        return slot.to(tl.int64) * stride_ks
    else:
        block, slot = resolve_blocks(bt_row_ptr, td_ptr, offs_n, mask_n, query_depth, stride_btp, num_planes,
                                     BLOCK_SIZE, LAST_EXITED)
        return block * stride_kb + slot * stride_ks


@triton.jit(do_not_specialize=STEP_VARYING)
def resolve_slots_kernel(
    slots_ptr, bt_ptr, td_ptr, seq_lens_ptr, qdepth_ptr,
    stride_sr, stride_btr, stride_btp, num_planes,
    BLOCK_SIZE: tl.constexpr, LAST_EXITED: tl.constexpr, BLOCK: tl.constexpr,
):
    """``slots[row, j] = block * BLOCK_SIZE + offset`` of key j's depth-resolved slot, j < seq_len.

    Run once per attention call before the attention kernel, so its key loop does one index load
    per tile instead of a chain of three (block table -> version map -> block table)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + row)
    if chunk * BLOCK >= seq_len:
        return
    qd = tl.load(qdepth_ptr + row)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < seq_len
    block, slot = resolve_blocks(bt_ptr + row.to(tl.int64) * stride_btr, td_ptr, offs, mask, qd, stride_btp,
                                 num_planes, BLOCK_SIZE, LAST_EXITED)
    tl.store(slots_ptr + row.to(tl.int64) * stride_sr + offs, (block * BLOCK_SIZE + slot).to(tl.int32), mask=mask)
