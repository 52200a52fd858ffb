"""The Triton kernel of :func:`rlt.platform.uva.mapped_copy_`: copy 32-bit words from pinned host
memory (dereferenced at its host address through unified virtual addressing) to device memory.
Imported on first use only (Triton is optional)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n"])  # n varies per step: one compile, not one per n % 16
def copy_words_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
