"""The values speculation adds to the Row model: draft rows, verification rows, and the step
result that carries draft tokens back to the scheduler policy.

Owns no state. A :class:`DraftRow` is a one-token row run for ``draft_loops`` loops (it exits at
depth ``draft_loops`` by construction); its position may hold a draft token the request has not
produced, which :meth:`DraftRow.token_ids` supplies to the batch builder. A :class:`VerifyRow`
covers the round's ``K+1`` positions starting at depth ``draft_loops``; its input is the drafts'
hidden states (kept by the executor).
"""

from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np

from rlt.platform.engine.interfaces import Row, StepResult

PLAIN, DRAFT, VERIFY = 0, 1, 2


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


@attrs.frozen(eq=False)
class VerifyRow(Row):
    role: int = VERIFY
    draft_loops: int = 1
    #: the draft tokens the row checks: drafts[i] is the token after position start + i
    drafts: tuple[int, ...] = ()


def row_column(rows: Sequence[Row], name: str, default, dtype) -> np.ndarray:
    """``getattr(row, name, default)`` for every row, as one array."""
    return np.fromiter((getattr(r, name, default) for r in rows), dtype, len(rows))


@attrs.frozen(eq=False)
class SpecStepResult(StepResult):
    """A step result that also carries, per row, the draft token a draft row made (-1: none)."""

    draft_tokens: np.ndarray | None = None
