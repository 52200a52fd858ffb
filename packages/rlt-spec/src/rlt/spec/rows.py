"""The values speculation adds to the Row model: draft rows, verification rows, chain rows, and
the step result that carries drafts and verdicts back to the scheduler policy.

Owns no state. Synchronous rounds: a :class:`DraftRow` is a one-token row run for ``draft_loops``
loops (it exits at depth ``draft_loops`` by construction); its position may hold a draft token the
request has not produced, which :meth:`DraftRow.token_ids` supplies to the batch builder. A
:class:`VerifyRow` covers the round's ``K+1`` positions starting at depth ``draft_loops``; its
input is the drafts' hidden states (kept by the executor).

Overlapped rounds (``async_self_spec``): a :class:`ChainRow` is a one-token row that runs all the
request's loops; at depth ``draft_loops`` the executor drafts the next token from it (the next
chain row starts from that draft in the following step, while this one keeps looping), and at full
depth it checks its own draft and yields exactly one token. A request may own several chain rows
of one step, one per in-flight position, at different depths.
"""

from __future__ import annotations

from typing import Sequence
from typing import ClassVar

import attrs
import numpy as np

from rlt.platform.engine.interfaces import Row, StepResult

PLAIN, DRAFT, VERIFY, CHAIN = 0, 1, 2, 3


@attrs.frozen(eq=False)
class DraftRow(Row):
    #: 1 for draft rows (read by the executor without isinstance checks)
    role: int = DRAFT
    #: position of this row in its round (0: the round's first token, already produced)
    index: int = 0
    #: drafts in the round (the row with ``index == num_drafts`` produces no draft)
    num_drafts: int = 0
    draft_loops: int = 1
    #: the draft token at this position (-1: the request's own token, ``index == 0``)
    token: int = -1

    def token_ids(self) -> Sequence[int]:
        return super().token_ids() if self.token < 0 else (self.token,)

    def own_input(self) -> bool:
        return self.token < 0


@attrs.frozen(eq=False)
class VerifyRow(Row):
    #: its input at depth d is the drafts' states (the executor's eager step), not a one-token row's
    static_decode: ClassVar[bool] = False
    role: int = VERIFY
    draft_loops: int = 1
    #: the draft tokens the row checks: drafts[i] is the token after position start + i
    drafts: tuple[int, ...] = ()


@attrs.frozen(eq=False)
class ChainRow(Row):
    role: int = CHAIN
    draft_loops: int = 1
    #: the input token at this position (-1: the request's own last token, the chain's first row)
    token: int = -1
    #: the draft this row made for the next position at depth ``draft_loops`` (-1: not yet)
    draft: int = -1
    #: its entry in the executor's state table (:func:`ring_entry`)
    state: int = 0

    def token_ids(self) -> Sequence[int]:
        return super().token_ids() if self.token < 0 else (self.token,)

    def own_input(self) -> bool:
        return self.token < 0

    @property
    def state_index(self) -> int:
        return self.state


def ring_entry(num_slots: int, ring: int, slot: int, position: int) -> int:
    """The state-table entry of the in-flight row of ``slot`` at ``position``: past the
    ``num_slots`` per-slot states, ``ring`` entries per slot (the executor's ``draft_h[slot,
    position % ring]``). In-flight rows of one request hold consecutive positions, at most
    ``ring`` of them, so their entries never collide."""
    return num_slots + slot * ring + position % ring


def row_column(rows: Sequence[Row], name: str, default, dtype) -> np.ndarray:
    """``getattr(row, name, default)`` for every row, as one array."""
    return np.fromiter((getattr(r, name, default) for r in rows), dtype, len(rows))


@attrs.frozen(eq=False)
class SpecStepResult(StepResult):
    """A step result that also carries, per row, the draft token a draft or chain row made (-1:
    none) and whether a chain row that reached full depth had its draft accepted."""

    draft_tokens: np.ndarray | None = None
    accepted: np.ndarray | None = None
