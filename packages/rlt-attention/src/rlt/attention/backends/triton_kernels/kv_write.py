"""Fused paged KV write: one launch scatters a step's K and V rows into their slots.

Grid ``(num_tokens, cdiv(kv_heads * head_dim, BLOCK))``. Slot ``s`` of a layer is the flat row
``s`` of ``k[layer].view(-1, kv_heads * head_dim)``; a negative slot (padding in a captured
graph's bucket) writes nothing. Inputs must be contiguous in (kv_heads, head_dim).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(
    k_cache_ptr, v_cache_ptr, key_ptr, value_ptr, slot_ptr,
    stride_key_n, stride_value_n,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tok = tl.program_id(0)
    part = tl.program_id(1)
    slot = tl.load(slot_ptr + tok)
    if slot < 0:
        return
    offs = part * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(key_ptr + tok.to(tl.int64) * stride_key_n + offs, mask=mask)
    v = tl.load(value_ptr + tok.to(tl.int64) * stride_value_n + offs, mask=mask)
    dst = slot.to(tl.int64) * ROW + offs
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
