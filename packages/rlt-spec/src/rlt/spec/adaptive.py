"""Adaptive K: how many tokens a request drafts per round, from its running acceptance rate.

The rule (documented in docs/spec.md). A round with K drafts made with d of D loops costs
``(K + 1) * d + (D - d)`` steps of the request (K+1 draft rows of d loops, then one verification
row of D - d loops) and yields ``E(K) = (1 - a**(K+1)) / (1 - a)`` tokens when each draft is
accepted with probability ``a`` (the accepted prefix plus the correction). A plain step yields
one token per D steps. K is the value in ``0..K_max`` with the highest ``E(K) / steps(K)``; it is
used only when that rate beats the plain ``1 / D`` by the factor ``1 + min_gain``, otherwise the
request decodes plainly (K = 0).

``a`` is estimated per request from decayed counts of accepted and rejected drafts (each round
adds its accepted count to the successes and one failure if it stopped before its last draft),
starting from a prior of weight 2 at ``initial_acceptance``. A request at K = 0 learns nothing,
so every ``probe_interval`` plain tokens it runs one round with K = 1 to re-measure.

This module owns the per-request estimate; it knows nothing of rows or devices.
"""

from __future__ import annotations

import attrs

PRIOR_WEIGHT = 2.0


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round of ``k`` drafts yields when each is accepted with probability ``alpha``."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def round_steps(k: int, draft_loops: int, num_loops: int) -> int:
    return (k + 1) * draft_loops + (num_loops - draft_loops)


def best_k(alpha: float, k_max: int, draft_loops: int, num_loops: int, min_gain: float) -> int:
    """The K of the rule above (0: decode plainly)."""
    best, best_rate = 0, (1.0 + min_gain) / num_loops
    for k in range(1, k_max + 1):
        rate = expected_tokens(alpha, k) / round_steps(k, draft_loops, num_loops)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


@attrs.define
class AcceptanceTracker:
    """Decayed acceptance counts of one request and the K they imply."""

    k_max: int
    draft_loops: int
    num_loops: int
    adaptive: bool = True
    initial_acceptance: float = 0.8
    decay: float = 0.9
    min_gain: float = 0.05
    probe_interval: int = 16
    accepted: float = 0.0
    rejected: float = 0.0
    plain_since_probe: int = 0
    #: totals, for stats
    rounds: int = 0
    drafted: int = 0
    total_accepted: int = 0

    @property
    def alpha(self) -> float:
        s0 = PRIOR_WEIGHT * self.initial_acceptance
        return (self.accepted + s0) / (self.accepted + self.rejected + PRIOR_WEIGHT)

    def next_k(self) -> int:
        """K for the request's next round (call once per token that could start one)."""
        if not self.adaptive:
            return self.k_max
        k = best_k(self.alpha, self.k_max, self.draft_loops, self.num_loops, self.min_gain)
        if k == 0 and self.k_max > 0:
            self.plain_since_probe += 1
            if self.plain_since_probe >= self.probe_interval:
                self.plain_since_probe = 0
                return 1
        return k

    def update(self, num_drafts: int, num_accepted: int) -> None:
        """Record a verified round: ``num_accepted`` of its ``num_drafts`` drafts were kept."""
        self.accepted = self.decay * self.accepted + num_accepted
        self.rejected = self.decay * self.rejected + (1.0 if num_accepted < num_drafts else 0.0)
        self.rounds += 1
        self.drafted += num_drafts
        self.total_accepted += num_accepted
