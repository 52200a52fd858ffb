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
