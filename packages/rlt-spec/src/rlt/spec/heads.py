"""A lagged step's greedy heads in one kernel: the hot path of overlapped chains at small batches.

After rlt-decode replays a step with chain rows, :meth:`SpeculativeExecutor.finish_decode_lagged`
runs its rows' heads: chain rows reaching depth ``d`` draft the next token into the token table,
chain rows reaching full depth check theirs (the slot's rejection flag, the slot's token), plain
rows that exit sample. In general that is the sampler's path — about 40 small eager launches on
a step with heads (index uploads, zero fills, index writes, argmaxes, compares, a stack), each a
few microseconds of device time on a step of ~1.3 ms at C = 1. When every head row takes the
argmax of its raw logits (:func:`rlt.platform.engine.sampler.argmax_only`: greedy, no logprobs,
logit bias, penalties or min_tokens suppression), the same step is one upload of a row
descriptor, the LM head over the head rows and one kernel (:mod:`rlt.spec.heads_kernel`), with the
same results: the argmax's first-index tie rule is torch's, the rejection flag and the slot's token
change exactly where the general path changes them (``tests/rlt-spec/test_heads.py`` compares the
two in Triton's interpreter, ``test_kernel_compiles_for_sm90`` compiles it). Triton devices only; on by
default since lease 14 timed it (+1.9-2.4 % tok/s at d = 2, K = 8 on an H100: ``docs/spec.md``),
``RLT_SPEC_FUSED_HEADS=0`` turns it off. A launch that raises (a compile failure) turns it off for the
engine's life, with a warning; that step takes the general path.
A step whose rows make no head at all (every other chain step at d = 2 of 4) needs nothing on the
device, fused heads or not: its (empty) result is known on the host.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from rlt.platform.engine.staging import to_device
from rlt.platform.models.fused_ops import triton_usable

#: The kernel's launch shape, vocabulary entries per iteration x warps: ``RLT_SPEC_HEADS_TILES=BLOCKxWARPS``
#: overrides it (``benchmarks/spec_heads_sweep.py`` times the candidates on a GPU). 16384 x 8: the sweep's
#: fastest at 1 and 2 rows on an H100 (lease 15: 5.4 / 5.6 us a launch over Ouro's 49,152 logits, against
#: 18.2 / 18.2 at the earlier 2048 x 4), and faster at 8 and 64 rows too (6.2 / 6.5 against 18.4 / 18.9).
DEFAULT_TILES = (16384, 8)


def heads_tiles() -> tuple[int, int]:
    """The launch shape: ``RLT_SPEC_HEADS_TILES`` (``BLOCKxWARPS``, BLOCK a power of two) or the default."""
    return _parse_tiles(os.environ.get("RLT_SPEC_HEADS_TILES", ""))


@functools.lru_cache(maxsize=8)  # read per head step: parsed once per setting
def _parse_tiles(text: str) -> tuple[int, int]:
    if not text:
        return DEFAULT_TILES
    try:
        block, warps = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"RLT_SPEC_HEADS_TILES={text!r}: expected BLOCKxWARPS, e.g. 4096x8") from None
    if block < 16 or block & (block - 1) or warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"RLT_SPEC_HEADS_TILES={text!r}: BLOCK a power of two >= 16, WARPS a power of two <= 32")
    return block, warps


def fused_heads_usable(t: torch.Tensor) -> bool:
    """Whether :func:`greedy_heads` runs for a step whose states are ``t``: not turned off
    (``RLT_SPEC_FUSED_HEADS=0``) and Triton there."""
    return os.environ.get("RLT_SPEC_FUSED_HEADS", "1") != "0" and triton_usable(t)


def greedy_heads(model, last: torch.Tensor, *, sampled: np.ndarray, drafting: np.ndarray, checking: np.ndarray,
                 entries: np.ndarray, slots: np.ndarray, token_table: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    """The heads of a lagged step's rows, all greedy: ``sampled`` (plain rows that exit), ``drafting``
    and ``checking`` (chain rows; ``entries`` their token-table entries, in that order) are batch row
    indices; ``slots`` every row's slot; ``last`` every row's end-of-loop state. Writes the drafts and
    the valid checks' tokens into ``token_table`` and the checks' rejections into ``dead``; returns
    ``[3, rows]`` int64 on the device: per row the token it yields, whether it counts, its verdict."""
    from rlt.spec.heads_kernel import CHECK, DRAFT, SAMPLE  # Triton: on first use only

    n = len(slots)
    heads = np.concatenate([sampled, drafting, checking])
    desc = np.zeros((5, n), np.int64)  # head index, role, entry, slot; then the head rows (one upload)
    desc[0] = -1
    desc[0, heads] = np.arange(len(heads))
    desc[1, sampled], desc[1, drafting], desc[1, checking] = SAMPLE, DRAFT, CHECK
    desc[2, np.concatenate([drafting, checking])] = entries
    desc[3] = slots
    desc[4, : len(heads)] = heads
    dev = to_device(desc, last.device)
    logits = model.coda(last.index_select(0, dev[4, : len(heads)]))
    return launch(logits, dev, n, token_table, dead)


def launch(logits: torch.Tensor, dev: torch.Tensor, n: int, token_table: torch.Tensor, dead: torch.Tensor,
           tiles: tuple[int, int] | None = None) -> torch.Tensor:
    """The kernel over ``n`` rows described by ``dev`` (:func:`greedy_heads`' descriptor), ``logits`` the head
    rows' logits: the ``[3, n]`` result."""
    from rlt.spec.heads_kernel import greedy_heads_kernel

    block, warps = tiles or heads_tiles()
    out = torch.empty(3, n, dtype=torch.int64, device=logits.device)
    greedy_heads_kernel[(n,)](logits, logits.stride(0), dev, n, logits.shape[1], token_table, dead.view(torch.uint8),
                              out, BLOCK=block, num_warps=warps)
    return out
