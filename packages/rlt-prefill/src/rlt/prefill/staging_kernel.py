"""The Triton kernel of ``prefill_uva``: copy a step's staged metadata words to the device.

``src`` is the pinned host bank (read through unified virtual addressing when the probe passed:
the kernel dereferences the host address directly, no copy engine); ``dst`` the device bank.
Imported on first use only.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n"])  # n varies per step: one compile, not one per n % 16
def stage_words_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
