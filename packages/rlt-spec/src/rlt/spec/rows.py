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
"""

from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np

from rlt.platform.engine.interfaces import Row, StepResult

PLAIN, DRAFT, VERIFY, CHAIN = 0, 1, 2, 3


def ring_entry(num_slots: int, ring: int, slot: int, position: int) -> int:
    """The state-table entry of the in-flight speculative row of ``slot`` at ``position``: past the
    ``num_slots`` per-slot states, ``ring`` entries per slot (the executor's ``draft_h[slot,
    position % ring]``). The in-flight rows of one request hold consecutive positions, at most
    ``ring`` of them, so their entries never collide."""
    return num_slots + slot * ring + position % ring


@attrs.frozen(eq=False)
class SpecRow(Row):
    """A speculative one-token row: its state-table entry, and its input token when that is a draft."""

    #: PLAIN / DRAFT / VERIFY / CHAIN (read by the executor without isinstance checks)
    role: int = PLAIN
    draft_loops: int = 1
    #: the input token at this position (-1: the request's own token)
    token: int = -1
    #: its entry in the executor's state table (:func:`ring_entry`)
    state: int = 0

    def token_ids(self) -> Sequence[int]:
        return super().token_ids() if self.token < 0 else (self.token,)

    def own_input(self) -> bool:
        return self.token < 0

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
    role: int = CHAIN
    #: the draft this row made for the next position at depth ``draft_loops`` (-1: not yet)
    draft: int = -1


def row_column(rows: Sequence[Row], name: str, default, dtype) -> np.ndarray:
    """``getattr(row, name, default)`` for every row, as one array."""
    return np.fromiter((getattr(r, name, default) for r in rows), dtype, len(rows))


@attrs.frozen(eq=False)
class SpecStepResult(StepResult):
    """A step result that also carries, per row, the draft token a draft or chain row made (-1:
    none) and whether a chain row that reached full depth had its draft accepted."""

    draft_tokens: np.ndarray | None = None
    accepted: np.ndarray | None = None
