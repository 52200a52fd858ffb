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

import attrs
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
                 entries: np.ndarray, slots: np.ndarray, token_table: torch.Tensor, dead: torch.Tensor,
                 wide: "WideHeads | None" = None) -> torch.Tensor:
    """The heads of a lagged step's rows, all greedy: ``sampled`` (plain rows that exit), ``drafting``
    and ``checking`` (chain rows; ``entries`` their token-table entries, in that order) are batch row
    indices; ``slots`` every row's slot; ``last`` every row's end-of-loop state. Writes the drafts and
    the valid checks' tokens into ``token_table`` and the checks' rejections into ``dead``; returns
    ``[3, rows]`` int64 on the device: per row the token it yields, whether it counts, its verdict.
    ``wide``: wide chains' rows too (checks against their candidates, drafts of their W best; then
    the winners' promotion, :mod:`rlt.spec.wide`)."""
    from rlt.spec.heads_kernel import CHECK, DRAFT, SAMPLE, WCHECK, WDRAFT  # Triton: on first use only

    n = len(slots)
    w = wide if wide is not None else WideHeads.none()
    heads = np.concatenate([sampled, drafting, checking, w.checking, w.drafting])
    desc = np.zeros((5, n), np.int64)  # head index, role, entry, slot; then the head rows (one upload)
    desc[0] = -1
    desc[0, heads] = np.arange(len(heads))
    desc[1, sampled], desc[1, drafting], desc[1, checking] = SAMPLE, DRAFT, CHECK
    desc[1, w.checking], desc[1, w.drafting] = WCHECK, WDRAFT
    desc[2, np.concatenate([drafting, checking])] = entries
    desc[2, np.concatenate([w.checking, w.drafting])] = w.entries
    desc[3] = slots
    desc[4, : len(heads)] = heads
    flat = desc.reshape(-1)
    if len(w.groups):
        flat = np.concatenate([flat, w.groups.reshape(-1)])
    dev = to_device(flat, last.device)
    logits = model.coda(last.index_select(0, dev[4 * n: 4 * n + len(heads)]))
    out = launch(logits, dev[: 5 * n], n, token_table, dead, winner=w.winner, width=w.width)
    if len(w.groups):
        w.promote(dev[5 * n:], token_table)
    return out


@attrs.frozen
class WideHeads:
    """A lagged step's wide-chain rows for :func:`greedy_heads`: checks (``checking``) against the ``width``
    candidates at consecutive entries, drafts (``drafting``: their ``width`` best into consecutive entries),
    ``entries`` for both in that order; ``winner`` the per-slot winner buffer; then the candidate groups'
    promotion (``groups [G, 4 + planes * (1 + width)]``, :func:`rlt.spec.heads_kernel.promote_kernel`'s
    descriptor) over the KV cache ``kv`` and the state table ``state``."""

    checking: np.ndarray
    drafting: np.ndarray
    entries: np.ndarray
    width: int = 1
    winner: torch.Tensor | None = None
    groups: np.ndarray = attrs.field(factory=lambda: np.zeros((0, 0), np.int64))
    planes: int = 0
    kv: object = None
    state: torch.Tensor | None = None

    @classmethod
    def none(cls) -> "WideHeads":
        e = np.zeros(0, np.int64)
        return cls(e, e, e)

    def promote(self, desc: torch.Tensor, token_table: torch.Tensor) -> None:
        """The candidate groups' winners (one launch); a failure raises :class:`PromotionError` (the heads
        before it have run: the step cannot take the general path instead)."""
        from rlt.spec.heads_kernel import promote_kernel

        kv, g = self.kv, self.groups.shape[0]
        k = kv.k
        grid = (g, 1 + self.planes * kv.num_layers * 2)
        try:
            promote_kernel[grid](desc, g, self.planes, kv.num_layers, k.stride(0), k.shape[3] * k.shape[4], token_table,
                                 self.winner, self.state, self.state.stride(0), self.state.shape[1], k, kv.v,
                                 kv.token_depth, W=self.width, BLOCK=1024, num_warps=4)
        except Exception as exc:  # noqa: BLE001 - re-raised with what it means
            raise PromotionError(f"wide chains' promotion kernel failed: {type(exc).__name__}: {exc}") from exc


class PromotionError(RuntimeError):
    """The fused wide-chain promotion failed after the step's heads ran."""


def launch(logits: torch.Tensor, dev: torch.Tensor, n: int, token_table: torch.Tensor, dead: torch.Tensor,
           tiles: tuple[int, int] | None = None, *, winner: torch.Tensor | None = None,
           width: int = 1) -> torch.Tensor:
    """The kernel over ``n`` rows described by ``dev`` (:func:`greedy_heads`' descriptor), ``logits`` the head
    rows' logits: the ``[3, n]`` result."""
    import triton

    from rlt.spec.heads_kernel import greedy_heads_kernel

    block, warps = tiles or heads_tiles()
    out = torch.empty(3, n, dtype=torch.int64, device=logits.device)
    greedy_heads_kernel[(n,)](logits, logits.stride(0), dev, n, logits.shape[1], token_table, dead.view(torch.uint8),
                              out, token_table if winner is None else winner, BLOCK=block, W=width,
                              WP=triton.next_power_of_2(width), num_warps=warps)
    return out
