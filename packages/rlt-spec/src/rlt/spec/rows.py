"""The values speculation adds to the Row model: draft rows, verification rows, chain rows, and
the step result that carries drafts and verdicts back to the scheduler policy.

Owns no state. Every speculative row is a one-token decode row whose state between loops lives at
its own entry of the executor's state table (:func:`ring_entry`: one ring of entries per slot,
indexed by position), so several rows of one request can share a step and a static decode path
(rlt-decode) runs them like plain decode rows.

Synchronous rounds of ``K`` drafts from position ``P``: a :class:`DraftRow` is a one-token row run
for ``draft_loops`` loops (it exits at depth ``draft_loops`` by construction); its position may
hold a draft token the request has not produced, which :meth:`DraftRow.token_ids` supplies to the
batch builder. Then ``K+1`` :class:`VerifyRow` s, one per position ``P..P+K``, enter at depth
``draft_loops`` from the drafts' states (the same entries) and run together to full depth, where
the round is verified; its tokens are reported on the row of position ``P``.

Overlapped rounds (``async_self_spec``): a :class:`ChainRow` is a one-token row that runs all the
request's loops; at depth ``draft_loops`` the executor drafts the next token from it (the next
chain row starts from that draft in the following step, while this one keeps looping), and at full
depth it checks its own draft and yields exactly one token. A request may own several chain rows
of one step, one per in-flight position, at different depths.

Wide chains (``--self-spec-width W``): the newest position runs the draft's ``W`` best tokens as
``W`` :class:`CandidateRow` s until they reach depth ``d``; then the candidate that ran the
full-depth token (the previous position's check, on the device) becomes the position's chain row
— its state, next drafts and draft-depth KV copied where the chain row reads them — so a draft
that is not the draft's first choice but among its ``W`` best is no longer a restart
(docs/spec.md, "Wide chains"). Each candidate keeps its draft-depth KV in private blocks
(``Row.own_pages``: its slot's page table with the position's page replaced below depth ``d``).
"""

from __future__ import annotations

from typing import ClassVar, Sequence

import attrs
import numpy as np

from rlt.platform.engine.interfaces import Row, StepResult

PLAIN, DRAFT, VERIFY, CHAIN = 0, 1, 2, 3


def ring_entry(num_slots: int, ring: int, slot: int, position: int) -> int:
    """The state-table entry of the in-flight speculative row of ``slot`` at ``position``: past the
    ``num_slots`` per-slot states, ``ring`` entries per slot (``slot``'s block, at ``position %
    ring``). The in-flight rows of one request hold consecutive positions, at most
    ``ring`` of them, so their entries never collide."""
    return num_slots + slot * ring + position % ring


def wide_entry(num_slots: int, ring: int, width: int, slot: int, candidate: int) -> int:
    """The state-table (and token-table) entry of ``slot``'s wide-chain candidate ``candidate``:
    past the per-slot states and the rings, ``width`` entries per slot. The token table holds the
    candidate's input token there (the drafts its position runs), the state table its state."""
    return num_slots * (1 + ring) + slot * width + candidate


#: ``SpecRow.token`` values that are not tokens: the request's own last token, a device-only draft
OWN, ON_DEVICE = -1, -2


@attrs.frozen(eq=False)
class SpecRow(Row):
    """A speculative one-token row: its state-table entry, and its input token when that is a draft."""

    #: read without the host (``Row.lagged_heads``): chain rows only (rounds need their drafts on the host)
    lagged_heads: ClassVar[bool] = False
    #: PLAIN / DRAFT / VERIFY / CHAIN (read by the executor without isinstance checks)
    role: int = PLAIN
    draft_loops: int = 1
    #: the input token at this position: a draft the host knows, OWN (the request's last token), or
    #: ON_DEVICE (the draft the previous position's row made, at ``token_entry`` of the token table)
    token: int = OWN
    #: its entry in the executor's state table (:func:`ring_entry`)
    state: int = 0
    #: with ``token == ON_DEVICE``: the token-table entry of its input draft
    token_entry: int = 0

    def token_ids(self) -> Sequence[int]:
        if self.token == ON_DEVICE:  # a placeholder: the executor embeds the device's draft
            return (0,)
        return super().token_ids() if self.token == OWN else (self.token,)

    def own_input(self) -> bool:
        return self.token == OWN

    def input_on_device(self) -> bool:
        return self.token == ON_DEVICE

    def input_token_entry(self) -> int:
        return self.token_entry if self.token == ON_DEVICE else self.slot

    @property
    def state_index(self) -> int:
        return self.state


@attrs.frozen(eq=False)
class DraftRow(SpecRow):
    role: int = DRAFT
    #: position of this row in its round (0: the round's first token, already produced)
    index: int = 0
    #: drafts in the round (the row with ``index == num_drafts`` produces no draft)
    num_drafts: int = 0


@attrs.frozen(eq=False)
class VerifyRow(SpecRow):
    role: int = VERIFY
    #: position of this row in its round (``start - index`` is the round's first position)
    index: int = 0
    #: drafts the round checks (its rows: ``num_drafts + 1``)
    num_drafts: int = 0
    #: the draft this position's full-depth logits judge: the token after it (-1: the round's last
    #: position, which only yields a token)
    draft: int = -1


@attrs.frozen(eq=False)
class ChainRow(SpecRow):
    """A chain row: its input is the previous row's draft on the device (ON_DEVICE), or the
    request's own token for a chain's first row (``first``: it also clears the slot's rejection
    flag on the device, see :mod:`rlt.spec.executor`)."""

    lagged_heads: ClassVar[bool] = True
    role: int = CHAIN
    #: the chain this row belongs to (a number per request's chains: results of an older chain's
    #: rows, read late, are told apart)
    chain: int = 0
    first: bool = False
    #: candidates per new position (> 1: a wide chain; its check judges the full-depth token against
    #: every candidate of the next position, on the device at the slot's ``wide_entry`` s)
    width: int = 1
    #: a wide chain's private blocks: per candidate, per draft-depth plane, one block
    lane: tuple[tuple[int, ...], ...] = ()
    #: a wide chain's candidate entries (``wide_entry``, per candidate)
    candidates: tuple[int, ...] = ()


@attrs.frozen(eq=False)
class CandidateRow(ChainRow):
    """Candidate ``candidate`` of a wide chain's newest position (module docstring): a depth < d
    row whose input is its draft (the token table at its entry, which is also its state's entry)
    and whose KV at the position's page, below depth ``d``, lives in its private blocks."""

    own_pages: ClassVar[bool] = True
    candidate: int = 0
    #: the state entry of the position's chain row (where the winner's state goes)
    chain_entry: int = 0

    def block_table(self, tables: np.ndarray) -> np.ndarray:
        t = tables[self.slot].copy()
        private = self.lane[self.candidate]
        t[: len(private), self.start // self.block_size] = private
        return t

    #: the KV pool's block size (the page of the row's position)
    block_size: int = 16


def row_column(rows: Sequence[Row], name: str, default, dtype) -> np.ndarray:
    """``getattr(row, name, default)`` for every row, as one array."""
    return np.fromiter((getattr(r, name, default) for r in rows), dtype, len(rows))


@attrs.frozen(eq=False)
class SpecStepResult(StepResult):
    """A step result that also carries, per row, the draft token a draft or chain row made (-1:
    none) and whether a chain row that reached full depth had its draft accepted."""

    draft_tokens: np.ndarray | None = None
    accepted: np.ndarray | None = None
    #: the shape of a lagged step (chain checks' tokens and verdicts not read yet; ``on_result``
    #: gets them)
    lagged: bool = False
