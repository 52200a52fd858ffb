"""Device side of programmatic dependent launch (``rlt.attention.pdl`` has the policy and contract)."""

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - a Triton without them never gets ENABLED (pdl_enabled is False)
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def dependent_wait(ENABLED: tl.constexpr):
    """First statement of a kernel launched with PDL: wait until the previous kernel has completed and
    its writes are visible (nothing is read or written before this)."""
    if ENABLED:
        gdc_wait()


@triton.jit
def launch_dependents(ENABLED: tl.constexpr):
    """Let the next kernel launch (its programs then wait in :func:`dependent_wait` for this one to
    complete): called after a kernel's main loop, so waiting programs do not hold SM resources while
    this kernel still streams its operands (triggering at the start measured slower at one row)."""
    if ENABLED:
        gdc_launch_dependents()


@triton.jit
def prefetch_rows_l2(W, rows, num_rows, stride_w, k0, ROW_ELEMS: tl.constexpr, LINE_ELEMS: tl.constexpr,
                     LINES: tl.constexpr, ENABLED: tl.constexpr):
    """Before :func:`dependent_wait`: ask L2 for ``ROW_ELEMS`` elements of each weight row ``rows`` (those
    below ``num_rows``) from column ``k0`` on — one ``prefetch.global.L2`` per ``LINE_ELEMS`` elements, a
    per-thread instruction (the bulk prefetch takes warp-uniform operands, so ptxas loops over a warp's
    addresses) — so this kernel's DRAM stream starts while its predecessor finishes. Weights are never
    written by a kernel, so touching them before the wait is safe, and a prefetch changes no value
    (``rlt.attention.pdl``). ``LINES``: a power of two >= ROW_ELEMS / LINE_ELEMS; addresses are clamped
    into the rows, so nothing outside the weight is named."""
    if ENABLED:
        offs = tl.minimum(tl.arange(0, LINES) * LINE_ELEMS, ROW_ELEMS - 1)
        safe_rows = tl.minimum(rows, num_rows - 1).to(tl.int64)
        ptrs = W + safe_rows[:, None] * stride_w + k0 + offs[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)
