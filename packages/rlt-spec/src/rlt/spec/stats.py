"""A step observer that counts speculation: rounds verified, drafts checked, drafts accepted.

Reads each step's rows and result only (never modifies them); benchmarks and tests register it
with ``engine.add_observer``.
"""

from __future__ import annotations

import attrs
import numpy as np

from rlt.spec.rows import VERIFY, row_column


@attrs.define
class SpecStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0

    @property
    def acceptance(self) -> float:
        """Fraction of checked drafts that were accepted (nan before any round)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    def on_step(self, batch, result) -> None:
        self.steps += 1
        role = row_column(batch.rows, "role", 0, np.int8)
        done = np.nonzero((role == VERIFY) & (result.num_tokens > 0))[0]
        if len(done):
            lens = np.fromiter((batch.rows[i].length for i in done), np.int64, len(done))
            self.rounds += len(done)
            self.drafted += int((lens - 1).sum())
            self.accepted += int((result.num_tokens[done] - 1).sum())
