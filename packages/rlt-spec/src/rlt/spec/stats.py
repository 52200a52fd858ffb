"""A step observer that counts speculation: rounds verified, drafts made, drafts accepted, and
rejections (a chain row that reaches full depth checks one draft and counts as a round of one).

``acceptance`` is the per-draft acceptance ``a`` of the cost model (docs/spec.md): accepted drafts
over accepted drafts plus rejections — the chance that a draft is accepted when every draft
before it in its round was. ``accepted_fraction`` (accepted over all drafts made) is lower for
synchronous rounds: the drafts after a round's first rejection are made but never judged.

As a step observer (:meth:`on_step`) it reads each step's rows and result only (never modifies
them); benchmarks and tests register it with ``engine.add_observer``. The speculating scheduler
keeps one too, fed round by round (:meth:`add_round`), and reports it for ``/metrics``
(:meth:`metrics`: ``rlt:spec_*``).
"""

from __future__ import annotations

import attrs
import numpy as np

from rlt.platform.engine.interfaces import FeatureMetric
from rlt.spec.rows import CHAIN, VERIFY, row_column


@attrs.define
class SpecStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0
    steps: int = 0

    @property
    def acceptance(self) -> float:
        """Per-draft acceptance: accepted / (accepted + rejections) (nan before any round)."""
        judged = self.accepted + self.rejected
        return self.accepted / judged if judged else float("nan")

    @property
    def accepted_fraction(self) -> float:
        """Accepted drafts over all drafts made (nan before any round)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    def reset(self) -> None:
        self.rounds = self.drafted = self.accepted = self.rejected = self.steps = 0

    def add_round(self, num_drafts: int, num_accepted: int) -> None:
        """One verified round (a chain row's check: one draft) that kept ``num_accepted`` drafts."""
        self.rounds += 1
        self.drafted += num_drafts
        self.accepted += num_accepted
        self.rejected += int(num_accepted < num_drafts)

    def metrics(self) -> list[FeatureMetric]:
        """The counts as ``FeatureMetric`` (``/metrics``: ``rlt:spec_*``), vLLM's spec-decode counters' kind."""
        judged = self.accepted + self.rejected
        return [
            FeatureMetric("spec_rounds", self.rounds,
                          "Speculative rounds verified (a chain row's check: a round of one draft)."),
            FeatureMetric("spec_draft_tokens", self.drafted, "Draft tokens made by verified rounds."),
            FeatureMetric("spec_accepted_tokens", self.accepted, "Draft tokens accepted (kept) by verification."),
            FeatureMetric("spec_rejections", self.rejected, "Verified rounds that rejected a draft."),
            FeatureMetric("spec_acceptance", self.accepted / judged if judged else 0.0,
                          "Per-draft acceptance so far: accepted / (accepted + rejections); 0 before any round.",
                          kind="gauge"),
        ]

    def on_step(self, batch, result) -> None:
        self.steps += 1
        role = row_column(batch.rows, "role", 0, np.int8)
        done = np.nonzero((role == VERIFY) & (result.num_tokens > 0))[0]
        if len(done):
            drafts = row_column([batch.rows[i] for i in done], "num_drafts", 0, np.int64)
            kept = result.num_tokens[done] - 1
            self.rounds += len(done)
            self.drafted += int(drafts.sum())
            self.accepted += int(kept.sum())
            self.rejected += int((kept < drafts).sum())
        checked = np.nonzero((role == CHAIN) & (result.num_tokens > 0))[0]
        if len(checked):
            ok = int(result.accepted[checked].sum())
            self.rounds += len(checked)
            self.drafted += len(checked)
            self.accepted += ok
            self.rejected += len(checked) - ok
