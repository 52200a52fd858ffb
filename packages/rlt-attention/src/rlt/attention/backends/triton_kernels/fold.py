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


@triton.jit
def split_tile_sum(acc_a, acc_b, parts_ptr, counter_ptr, tile, split, rows, SPLITS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split-K over a tile of two fp32 accumulators ``[BLOCK_M, BLOCK_N]`` (rows below ``rows`` are live):
    with ``SPLITS`` > 1 this program stores its pieces at ``parts_ptr`` (tile-major: ``tile``, split,
    a/b), takes a ticket, and the last of the tile's ``SPLITS`` programs returns the sums of all pieces
    in split order (whichever program is last: deterministic) and True; the others return False.
    With one split: the accumulators themselves and True."""
    if SPLITS == 1:
        out_a = acc_a
        out_b = acc_b
        finish = True
    else:
        TILE: tl.constexpr = BLOCK_M * BLOCK_N
        offs_m = tl.arange(0, BLOCK_M)
        offs = offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        live = (offs_m < rows)[:, None]
        base = parts_ptr + tile.to(tl.int64) * (SPLITS * 2 * TILE)
        tl.store(base + (2 * split) * TILE + offs, acc_a, mask=live)
        tl.store(base + (2 * split + 1) * TILE + offs, acc_b, mask=live)
        finish = last_arrival(counter_ptr + tile, SPLITS)
        out_a = acc_a
        out_b = acc_b
        if finish:
            out_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            out_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                out_a += tl.load(base + (2 * s) * TILE + offs, mask=live, other=0.0, cache_modifier=".cg")
                out_b += tl.load(base + (2 * s + 1) * TILE + offs, mask=live, other=0.0, cache_modifier=".cg")
            reset_counter(counter_ptr + tile)
    return out_a, out_b, finish
