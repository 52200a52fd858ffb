"""Adaptive K: how many tokens a request drafts per round, from its running acceptance rate.

The rule (documented in docs/spec.md), in steps of the request at C = 1 (one loop per step).

Synchronous rounds: a round with K drafts made with d of D loops costs ``(K + 1) * d + (D - d)``
steps (K+1 draft rows of d loops, then one verification row of D - d loops) and yields
``E(K) = (1 - a**(K+1)) / (1 - a)`` tokens when each draft is accepted with probability ``a``
(the accepted prefix plus the correction): :func:`sync_steps_per_token`.

Overlapped rounds (chains, ``async_self_spec``): a chain row starts every d steps while at most
K drafts are unverified, each yields one token, and a rejection restarts the chain D steps after
the rejected row started: :func:`async_steps_per_token`.

A plain token costs D steps. K is the value in ``0..K_max`` with the fewest steps per token (the
smallest such K on ties); it is used only when its rate beats the plain ``1 / D`` by the factor
``1 + min_gain``, otherwise the request decodes plainly (K = 0).

``a`` is estimated per request from decayed counts of accepted and rejected drafts (each round
adds its accepted count to the successes and one failure if it stopped before its last draft),
starting from a prior of weight 2 at ``initial_acceptance``. The counts decay by ``decay`` per
*judged* draft (the accepted ones plus the rejected one), so the estimate's window is about
``1 / (1 - decay)`` drafts in both modes: a synchronous round judges up to K drafts, a chain's
verdict one. (Decaying per verdict made a chain's window ten drafts: at a = 0.79 the estimate
fell below break-even often enough that the request spent whole probe intervals decoding plainly
— 3.34 steps per token against 2.84 for fixed K on the H200, lease 6.)

A request at K = 0 learns nothing, so every ``probe_interval * max(1, step_cost)`` plain tokens
it runs one round with K = 1 to re-measure (the interval grows with the cost of a speculative
step, so probing costs about the same share of time), unless no K would pay even at full
acceptance (then it never probes).

This module owns the per-request estimate; it knows nothing of rows or devices.
"""

from __future__ import annotations

import functools

import attrs

PRIOR_WEIGHT = 2.0


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round of ``k`` drafts yields when each is accepted with probability ``alpha``."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def round_steps(k: int, draft_loops: int, num_loops: int) -> int:
    return (k + 1) * draft_loops + (num_loops - draft_loops)


def sync_steps_per_token(alpha: float, k: int, draft_loops: int, num_loops: int) -> float:
    """Expected steps per token of synchronous rounds of ``k`` drafts (``k = 0``: plain, D)."""
    return round_steps(k, draft_loops, num_loops) / expected_tokens(alpha, k) if k else float(num_loops)


def async_steps_per_token(alpha: float, k: int, draft_loops: int, num_loops: int, lag: int = 0) -> float:
    """Expected steps per token of a chain (overlapped rounds) with at most ``k`` unverified drafts.

    Chain row j (after a restart) starts at step ``t_j = (j // m) * T + (j % m) * d`` with
    ``m = k + 1`` and ``T = max(D, m * d)`` (row j + m waits for row j to be verified when
    ``m * d < D``); the first rejected row J (``P(J = j) = a**j (1 - a)``) ends the chain, which
    restarts at ``t_J + D + lag`` after J + 1 tokens (``lag``: steps until the host reads the
    verdict — the pipeline's depth when chains are read back lagged). So steps per token =
    ``E[t_J + D + lag] / E[J + 1]``: ``d + (1 - a)(D - d + lag)`` when ``m * d >= D``; ``T / m``
    at ``a = 1``; ``D + lag`` at ``a = 0``.
    """
    d, D = draft_loops, num_loops
    if not k:
        return float(D)
    m = k + 1
    period = max(D, m * d)
    if alpha >= 1.0:
        return period / m
    am = alpha ** m
    groups = am / (1.0 - am)  # E[J // m]
    within = sum(r * alpha ** r for r in range(m)) * (1.0 - alpha) / (1.0 - am)  # E[J % m]
    return (1.0 - alpha) * (period * groups + d * within + D + lag)


def best_k(alpha: float, k_max: int, draft_loops: int, num_loops: int, min_gain: float,
           overlap: bool = False, step_cost: float = 1.0, lag: int = 0) -> int:
    """The K of the rule above (0: decode plainly)."""
    best, best_rate = 0, (1.0 + min_gain) / num_loops
    for k in range(1, k_max + 1):
        steps = (async_steps_per_token(alpha, k, draft_loops, num_loops, lag) if overlap
                 else sync_steps_per_token(alpha, k, draft_loops, num_loops))
        rate = 1.0 / (steps * step_cost)
        if rate > best_rate * (1.0 + 1e-9):
            best, best_rate = k, rate
    return best


@functools.lru_cache(maxsize=256)
def pays_at_full_acceptance(k_max: int, draft_loops: int, num_loops: int, min_gain: float, overlap: bool,
                            step_cost: float, lag: int) -> bool:
    """Whether some K beats plain decoding when every draft is accepted (independent of the counts)."""
    return best_k(1.0, k_max, draft_loops, num_loops, min_gain, overlap, step_cost, lag) > 0


@attrs.define
class AcceptanceTracker:
    """Decayed acceptance counts of one request and the K they imply."""

    k_max: int
    draft_loops: int
    num_loops: int
    adaptive: bool = True
    #: overlapped rounds (chains): K bounds the unverified drafts in flight
    overlap: bool = False
    initial_acceptance: float = 0.8
    #: per judged draft (window ~ 1 / (1 - decay) drafts)
    decay: float = 0.97
    min_gain: float = 0.05
    #: a speculative step's cost in plain decode steps
    step_cost: float = 1.0
    #: steps until a chain's verdict is read (overlapped rounds read back lagged: the pipeline's depth)
    lag: int = 0
    probe_interval: int = 16
    accepted: float = 0.0
    rejected: float = 0.0
    plain_since_probe: int = 0
    #: totals, for stats
    rounds: int = 0
    drafted: int = 0
    total_accepted: int = 0
    #: the rule's K for the current counts (None: not computed since the last update). The scheduler
    #: asks once or twice per step; the overlapped rule costs tens of microseconds of Python, which a
    #: step of ~1.5 ms (H200, C = 1) cannot hide behind the device at pipeline depth 1.
    _k: int | None = attrs.field(default=None, init=False, repr=False, eq=False)

    @property
    def alpha(self) -> float:
        s0 = PRIOR_WEIGHT * self.initial_acceptance
        return (self.accepted + s0) / (self.accepted + self.rejected + PRIOR_WEIGHT)

    @property
    def can_pay(self) -> bool:
        """Whether some K would beat plain decoding at full acceptance (else the request never probes)."""
        return pays_at_full_acceptance(self.k_max, self.draft_loops, self.num_loops, self.min_gain, self.overlap,
                                       self.step_cost, self.lag)

    def current_k(self) -> int:
        """The rule's K for the current estimate (no probing; memoised until the next update)."""
        if not self.adaptive:
            return self.k_max
        if self._k is None:
            self._k = best_k(self.alpha, self.k_max, self.draft_loops, self.num_loops, self.min_gain, self.overlap,
                             self.step_cost, self.lag)
        return self._k

    def next_k(self) -> int:
        """K for the request's next round (call once per token that could start one); a request
        at K = 0 probes with K = 1 every ``probe_interval`` calls."""
        k = self.current_k()
        if not self.adaptive:
            return k
        if k == 0 and self.k_max > 0:
            if not self.can_pay:  # not even at full acceptance: nothing to learn by probing
                return 0
            self.plain_since_probe += 1
            if self.plain_since_probe >= self.probe_interval * max(1.0, self.step_cost):
                self.plain_since_probe = 0
                return 1
        return k

    def update(self, num_drafts: int, num_accepted: int) -> None:
        """Record a verified round: ``num_accepted`` of its ``num_drafts`` drafts were kept."""
        self._k = None
        rejected = 1.0 if num_accepted < num_drafts else 0.0
        keep = self.decay ** (num_accepted + rejected)
        self.accepted = keep * self.accepted + num_accepted
        self.rejected = keep * self.rejected + rejected
        self.rounds += 1
        self.drafted += num_drafts
        self.total_accepted += num_accepted
