"""Device side of the last-arriver folds (``rlt.attention.fold`` has the policy and the ordering argument)."""

import triton
import triton.language as tl


@triton.jit
def last_arrival(counter_ptr, arrivals):
    """Call after this program has stored its piece: True in the one program (of the ``arrivals`` that
    share ``counter_ptr``) that arrives last. That program reads the pieces with ``.cg`` loads, reduces
    them, and calls :func:`reset_counter`."""
    tl.debug_barrier()  # every thread's piece is stored before the ticket releases them
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    return ticket == arrivals - 1


@triton.jit
def reset_counter(counter_ptr):
    """Zero the counter for the next launch (every other program has taken its ticket)."""
    tl.store(counter_ptr, 0)
