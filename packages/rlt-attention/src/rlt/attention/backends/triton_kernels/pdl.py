"""Device side of programmatic dependent launch (``rlt.attention.pdl`` has the policy and contract)."""

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - a Triton without them never gets ENABLED (pdl_enabled is False)
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def dependent_launch(ENABLED: tl.constexpr):
    """First statement of a kernel launched with PDL: let the next kernel launch now, then wait until
    the previous one has completed and its writes are visible (nothing is read or written before)."""
    if ENABLED:
        gdc_launch_dependents()
        gdc_wait()
