"""The speculating scheduler policy: a wrapper that turns a speculating request's decode steps
into rounds (synchronous: draft rows, then verification rows; overlapped: a chain of rows).

The inner policy keeps owning admission, slots, KV and every request's row. While a request is
in a round, the inner policy's row for it stays its plain decode row of its next token (position
``P``); this wrapper substitutes the round's rows in each plan and, when a row yields tokens,
hands the inner policy that plain row as if it had exited with them, so the inner policy moves on
to the next position as for any decode step.

Synchronous rounds: a round starts whenever a speculating request's row is a plain depth-0 decode
row: K comes from its :class:`AcceptanceTracker`, capped by the remaining ``max_tokens`` (the
round emits at most K+1 tokens), the step budget, and the KV manager (``grow`` to ``P + K + 1``
positions); K = 0 leaves the plain row (a plain step). The round's ``K+1`` verification rows
(one per position) run together from depth ``d``; entering, the round is shortened (its last
positions, so its last drafts, dropped) when the step's rows would exceed ``max_num_batched_tokens``.

Overlapped rounds (``overlap``, the ``async_self_spec`` feature): a :class:`Chain` of one-token
rows at consecutive positions ``P, P+1, ...``, oldest (deepest) first. The newest row drafts the
next token when it reaches depth ``d``; the next step starts a row at the next position from that
draft (depth 0) while the others keep looping, as long as at most K drafts are unverified (K
from the tracker, re-read at each extension), the remaining ``max_tokens`` covers every row in
flight, the step budget has room and the KV manager can ``grow``. When the oldest row reaches
full depth it yields one token (its draft if accepted, else the correction); a rejection drops
the rest of the chain — its rows ran on a wrong token — and the request goes on from the
correction (a new chain, or plain decoding). Rows past the step budget wait a step (always a
suffix of the chain, so an older row is never shallower than a newer one).

Adaptive K also holds speculation off (no new rounds, no chain extensions) while more than
``max_running`` requests run (``--self-spec-max-running``): at large batches a decode step is no
longer one weight read shared by every row, so the step-count rule does not hold there.

While a request's round or chain is open it is held against preemption
(``Request.preemption_holds``): its drafts and draft hidden states live only here and in the
executor's state table, which a preempting policy cannot save; between rounds it is preemptible
like any decode request (a swapped or recomputed request resumes from its recorded tokens).

Wide chains (``--self-spec-width W`` > 1): a greedy request whose draft depth is at least half
its depth (a position's check must come no later than the next position's drafts) and that holds
one of the ``lanes`` (each ``W`` private blocks per draft-depth plane, reserved from the KV pool at
startup; a request keeps its lane until it finishes; a chain starts wide only while no more requests
run than there are lanes, ``--self-spec-wide-lanes``, default 1) runs each new position as ``W`` candidate rows
until depth ``d`` (:class:`rlt.spec.rows.CandidateRow`), then as its chain row; other requests run
plain chains. The host's view is unchanged: one row per position, one verdict per check.

Per-request checks (:meth:`add`): speculation with adaptive exit, ``draft_loops`` not below the
request's depth, K above the engine cap or the step budget are refused, naming the setting; so is
speculation asked for by a request with repetition / frequency / presence penalties (each verified
position would need the penalties of the drafts before it), which under the engine's default K
decodes plainly instead.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import attrs
import numpy as np

from rlt.platform.engine.exit_policy import is_adaptive
from rlt.platform.engine.interfaces import Row, StepPlan, StepResult, Wrapped
from rlt.platform.engine.request import Request
from rlt.platform.errors import InvalidRequestError
from rlt.spec.adaptive import AcceptanceTracker
from rlt.spec.rows import (CHAIN, ON_DEVICE, PLAIN, VERIFY, CandidateRow, ChainRow, DraftRow, VerifyRow, ring_entry,
                           row_column, wide_entry)
from rlt.spec.stats import SpecStats

#: this feature's name in ``Request.preemption_holds``
HOLD = "self_spec"


@attrs.define(eq=False)
class Round:
    plain: Row  # the inner policy's row for the request (the round's first token, depth 0)
    rows: list[Row]  # the round's rows in the next step: one draft row, or its verification rows
    drafts: list[int] = attrs.field(factory=list)


@attrs.define(eq=False)
class Chain:
    plain: Row  # the inner policy's row for the request (its next token's position, depth 0)
    rows: list[ChainRow]  # in flight: consecutive positions, oldest (deepest) first
    id: int = 0
    #: rows that reached full depth (left ``rows``) whose verdicts the host has not read yet
    unconfirmed: int = 0


class SpeculativeScheduler(Wrapped):
    accepts_speculation = True

    def __init__(self, inner, *, options, kv, num_loops: int, max_num_batched_tokens: int, num_slots: int,
                 overlap: bool = False, lag: int = 0, width: int = 1) -> None:
        super().__init__(inner)
        #: wide chains' candidates per position (1: plain chains only) and the lanes of private blocks
        #: (per lane, per candidate, per plane below the model's depth), free ones and each request's
        self.width = width  # 1 unless overlapped (rlt.spec.feature.wide_width)
        self.lanes_free: list[tuple[tuple[int, ...], ...]] = []
        self.lanes: "weakref.WeakKeyDictionary[Request, tuple]" = weakref.WeakKeyDictionary()
        if self.width > 1:
            per_lane = self.width * (num_loops - 1)
            for _ in range(min(num_slots, options.wide_lanes)):
                blocks = kv.reserve(per_lane) if hasattr(kv, "reserve") else None
                if blocks is None:
                    break
                self.lanes_free.append(tuple(tuple(blocks[j * (num_loops - 1):(j + 1) * (num_loops - 1)])
                                             for j in range(self.width)))
        self.num_lanes = len(self.lanes_free)  # lanes reserved (wide chains at once: at most this many)
        #: steps until a chain's verdict is read (chains read back lagged: the pipeline's depth, at most
        #: ``options.chain_lag``: :attr:`max_in_flight`)
        self.lag = lag
        #: chain rows' state-table entries (:func:`ring_entry`): the executor's slots and ring size
        self.num_slots = num_slots
        self.ring = options.max_num_tokens + 1
        self.options = options
        self.kv = kv
        self.num_loops = num_loops
        self.budget = max_num_batched_tokens
        #: overlapped rounds (chains) instead of synchronous ones, for every speculating request
        self.overlap = overlap
        self.trackers: "weakref.WeakKeyDictionary[Request, AcceptanceTracker]" = weakref.WeakKeyDictionary()
        self.rounds: "weakref.WeakKeyDictionary[Request, Round]" = weakref.WeakKeyDictionary()
        self.chains: "weakref.WeakKeyDictionary[Request, Chain]" = weakref.WeakKeyDictionary()
        self._chain_ids = 0
        #: every verified round of every request (``/metrics``: :meth:`feature_metrics`)
        self.totals = SpecStats()

    @property
    def max_in_flight(self) -> int | None:
        """The most steps a pipelined step loop should keep in flight now (``SchedulerPolicy``): while a chain
        is open, ``chain_lag`` — its verdicts are read that many steps late, and each rejection costs as many
        steps (docs/spec.md); else no limit of this policy's (None)."""
        return self.options.chain_lag if self.overlap and self.chains else None

    @property
    def max_decode_rows(self) -> int:
        """The most one-token rows a step may hold (a static decode path sizes its buffers by it; a
        step with more rows runs eagerly): one per request, plus, for each request that may
        speculate at once, the rest of its rows — a round verifies up to ``ring`` positions at once;
        a chain has at most ``ring`` rows in flight and at most one per loop (rows start at least
        one loop apart). Adaptive K with the ``max_running`` gate lets at most ``max_running``
        requests speculate at once; a wide chain (at most ``wide_lanes`` at once) holds at most its older
        position's row and the newest one's candidates. All within the step budget."""
        o = self.options
        speculating = self.num_slots if not (o.adaptive and o.max_running) else min(self.num_slots, o.max_running)
        if not self.overlap:
            return max(1, min(self.budget, self.num_slots + speculating * (self.ring - 1)))
        per_chain = min(self.ring, self.num_loops)
        wide = min(speculating, self.num_lanes) * max(0, 1 + self.width - per_chain)  # no lanes at width 1
        return max(1, min(self.budget, self.num_slots + speculating * (per_chain - 1) + wide))

    # -- requests ------------------------------------------------------------------------------
    def resolve(self, request: Request) -> AcceptanceTracker | None:
        """The request's speculation (None: it decodes plainly), or InvalidRequestError."""
        o = self.options
        spec = request.params.speculation
        k = o.num_tokens if spec is None else spec.num_tokens
        d = (spec.draft_loops if spec is not None else None) or o.resolved_draft_loops(self.num_loops)
        if k == 0:
            return None
        if request.params.penalized:  # a verified position's penalties would need the drafts before it counted
            if spec is None:
                return None  # the engine's default K: this request decodes plainly
            raise InvalidRequestError(
                "speculation: self-speculation does not combine with repetition / frequency / presence "
                "penalties; leave speculation unset (the request then decodes without it) or the penalties at "
                "their defaults", "speculation")
        where = "speculation" if spec is not None else "--self-spec"
        if is_adaptive(request.exit_threshold):
            raise InvalidRequestError(
                f"{where}: self-speculation needs fixed depth, but exit_threshold is {request.exit_threshold} "
                "(adaptive exit); set exit_threshold to 1.0 or leave speculation unset", "speculation")
        if d >= request.max_loops:
            raise InvalidRequestError(
                f"{where}.draft_loops: {d} must be below the request's depth ({request.max_loops} loops)",
                "speculation.draft_loops")
        if k > o.max_num_tokens:
            raise InvalidRequestError(
                f"{where}.num_tokens: {k} exceeds this engine's limit of {o.max_num_tokens} "
                "(--self-spec-max-num-tokens)", "speculation.num_tokens")
        if k + 1 > self.budget:
            raise InvalidRequestError(
                f"{where}.num_tokens: {k} + 1 verified positions exceed max_num_batched_tokens ({self.budget})",
                "speculation.num_tokens")
        return AcceptanceTracker(k_max=k, draft_loops=d, num_loops=request.max_loops, adaptive=o.adaptive,
                                 overlap=self.overlap, initial_acceptance=o.initial_acceptance,
                                 min_gain=o.min_gain, step_cost=o.resolved_step_cost(()), probe_interval=o.probe_interval,
                                 lag=self.lag if self.overlap else 0)

    def add(self, request: Request) -> None:
        tracker = self.resolve(request)
        self.inner.add(request)
        if tracker is not None:
            self.trackers[request] = tracker

    def finish(self, request: Request) -> None:
        lane = self.lanes.pop(request, None)
        if lane is not None:
            self.lanes_free.append(lane)
        self.rounds.pop(request, None)
        self.chains.pop(request, None)
        self.trackers.pop(request, None)
        request.preemption_holds.discard(HOLD)
        self.inner.finish(request)

    def _hold(self, request: Request) -> None:
        """Hold the request against preemption while its round or chain is open (module docstring);
        a chain with no rows left and every verdict read has ended (nothing of it is in flight)."""
        chain = self.chains.get(request)
        if chain is not None and not chain.rows and not chain.unconfirmed:
            del self.chains[request]
        if request in self.rounds or request in self.chains:
            request.preemption_holds.add(HOLD)
        else:
            request.preemption_holds.discard(HOLD)

    def acceptance(self, request: Request) -> AcceptanceTracker | None:
        return self.trackers.get(request)

    def feature_metrics(self) -> list:
        """Speculation counters (``rlt:spec_*``: rounds, draft and accepted tokens, rejections, and the
        per-draft acceptance), then the inner policy's."""
        inner = getattr(self.inner, "feature_metrics", None)
        return self.totals.metrics() + (list(inner()) if callable(inner) else [])

    # -- steps ---------------------------------------------------------------------------------
    def speculation_allowed(self) -> bool:
        """Whether new rounds may start (and chains grow) now: adaptive K holds speculation off
        while more than ``max_running`` requests run."""
        o = self.options
        return not o.adaptive or not o.max_running or self.inner.num_running <= o.max_running

    def _start(self, row: Row, tracker: AcceptanceTracker, budget_left: int) -> Round | None:
        req = row.request
        remaining = req.max_tokens - req.num_produced
        k = min(tracker.next_k(), remaining - 1, budget_left - 1)
        if k <= 0 or not self.kv.grow(row.slot, req, row.start + k + 1):
            return None
        first = DraftRow(req, row.slot, row.start, 1, 0, samples=False, in_prompt=False, index=0,
                         num_drafts=k, draft_loops=tracker.draft_loops, state=self._entry(row.slot, row.start))
        return Round(row, [first])

    def schedule(self) -> StepPlan:
        plan = self.inner.schedule()
        allowed = self.speculation_allowed()
        out: list[Row | Round] = []
        used = sum(r.length for r in plan.rows)
        for row in plan.rows:
            tracker = self.trackers.get(row.request)
            if tracker is None:
                out.append(row)
                continue
            if self.overlap:
                chain_rows = self._chain_rows(row, tracker, allowed, self.budget - used + row.length)
                used += len(chain_rows) - row.length
                out.extend(chain_rows)
                continue
            rnd = self.rounds.get(row.request)
            if rnd is None and allowed and row.depth == 0 and not row.in_prompt and row.length == 1:
                rnd = self._start(row, tracker, self.budget - used + 1)
                if rnd is not None:
                    self.rounds[row.request] = rnd
                    self._hold(row.request)
            if rnd is not None:
                used += len(rnd.rows) - row.length
            out.append(row if rnd is None else rnd)
        if used > self.budget:
            self._shrink([it for it in out if isinstance(it, Round)], used - self.budget)
        rows = tuple(r for it in out for r in (it.rows if isinstance(it, Round) else (it,)))
        return StepPlan(rows, plan.failed)

    def _chain_rows(self, row: Row, tracker: AcceptanceTracker, allowed: bool, room: int) -> list[Row]:
        """The request's rows of this step: its chain's (started or extended here), its plain row,
        or none (its chain has no rows left but verdicts in flight: the inner policy's row moves on
        only when they are read)."""
        req = row.request
        chain = self.chains.get(req)
        if chain is not None and not chain.rows:  # verdicts in flight (an ended chain is gone: _hold)
            return []
        if chain is None:
            if not allowed or row.depth != 0 or row.in_prompt or row.length != 1:
                return [row]
            if req.max_tokens - req.num_produced < 2 or tracker.next_k() <= 0:
                return [row]
            self._chain_ids += 1
            chain = Chain(row, [ChainRow(req, row.slot, row.start, 1, 0, samples=False, in_prompt=False,
                                         draft_loops=tracker.draft_loops, state=self._entry(row.slot, row.start),
                                         chain=self._chain_ids, first=True, **self._wide(req, row.slot, tracker))],
                          id=self._chain_ids)
            self.chains[req] = chain
            self._hold(req)
        chain.plain = row
        last = chain.rows[-1]
        n = len(chain.rows)
        # the newest row has drafted (it ran loop d) — its draft is on the device, where the new row
        # embeds it; every row in flight or unconfirmed yields a token: never past max_tokens
        if (last.depth >= last.draft_loops and allowed and n + last.width - 1 < room and n <= tracker.current_k()
                and n + chain.unconfirmed < req.max_tokens - req.num_produced
                and self.kv.grow(row.slot, req, last.start + 2)):
            chain.rows.append(ChainRow(req, row.slot, last.start + 1, 1, 0, samples=False, in_prompt=False,
                                       draft_loops=last.draft_loops, token=ON_DEVICE, token_entry=last.state,
                                       state=self._entry(row.slot, last.start + 1), chain=chain.id,
                                       width=last.width, lane=last.lane, candidates=last.candidates))
        out: list[Row] = []
        for r in chain.rows:  # a whole position or none (rows past the budget wait: a suffix)
            rows = self._candidates(r) if r.width > 1 and not r.first and r.depth < r.draft_loops else [r]
            if out and len(out) + len(rows) > room:
                break
            out.extend(rows)
        return out

    def _wide(self, req: Request, slot: int, tracker: AcceptanceTracker) -> dict:
        """A new chain's wide fields: a lane (the request's, or a free one) when the request can run
        wide (greedy, draft depth at least half its depth) and no more requests run than there are lanes
        (``wide_lanes``: each candidate row reads the whole context), else none (a plain chain)."""
        d = tracker.draft_loops
        if (self.width < 2 or req.params.temperature > 0 or 2 * d < req.max_loops
                or self.inner.num_running > self.options.wide_lanes):
            return {}
        lane = self.lanes.get(req)
        if lane is None:
            if not self.lanes_free:
                return {}
            lane = self.lanes[req] = self.lanes_free.pop()
        return {"width": self.width, "lane": tuple(blocks[:d] for blocks in lane),
                "candidates": tuple(wide_entry(self.num_slots, self.ring, self.width, slot, j)
                                    for j in range(self.width))}

    def _candidates(self, row: ChainRow) -> list[Row]:
        """A wide chain's newest position below depth d: one row per candidate."""
        return [CandidateRow(row.request, row.slot, row.start, 1, row.depth, samples=False, in_prompt=False,
                             draft_loops=row.draft_loops, token=ON_DEVICE, token_entry=entry, state=entry,
                             chain=row.chain, width=row.width, lane=row.lane, candidates=row.candidates,
                             candidate=j, chain_entry=row.state, block_size=self.kv.block_size)
                for j, entry in enumerate(row.candidates)]

    def _entry(self, slot: int, position: int) -> int:
        return ring_entry(self.num_slots, self.ring, slot, position)

    @staticmethod
    def _shrink(rounds: list[Round], excess: int) -> None:
        """Drop the trailing positions (drafts) of rounds whose verification enters this step until
        the rows fit: the round then checks fewer drafts."""
        for rnd in sorted(rounds, key=lambda r: -len(r.rows)):
            if excess <= 0:
                break
            first = rnd.rows[0]
            if first.role != VERIFY or first.depth != first.draft_loops or len(rnd.rows) == 1:
                continue
            cut = min(excess, len(rnd.rows) - 1)
            k = len(rnd.rows) - 1 - cut
            rnd.rows = [attrs.evolve(r, num_drafts=k, draft=r.draft if r.index < k else -1) for r in rnd.rows[: k + 1]]
            excess -= cut

    def advance(self, rows: Sequence[Row], result: StepResult, done: set[Request]) -> None:
        """Move the step's rows on. A lagged step's ``result`` is its shape: chains move on (their
        rows reaching full depth leave, unconfirmed), their verdicts come to :meth:`on_result`."""
        role = row_column(rows, "role", PLAIN, np.int8)
        if not role.any():  # plain rows only (also a lagged step's shape, whose tokens are not read)
            self.inner.advance(rows, result, done)
            return
        lagged = getattr(result, "lagged", False)
        off = result.token_offsets
        drafts = getattr(result, "draft_tokens", None)
        keep: list[int] = []  # rows the inner policy moves on (plain ones, finished rounds)
        inner_rows: list[Row] = []
        chained: dict[Request, dict[int, int]] = {}  # request -> position -> row index
        verifying: dict[Request, list[int]] = {}  # request -> its verification rows' indices
        for i, row in enumerate(rows):
            req = row.request
            if role[i] == PLAIN:
                keep.append(i)
                inner_rows.append(row)
                continue
            if role[i] == VERIFY and row.index == 0 and off[i + 1] > off[i]:  # a round verified (its tokens)
                self.totals.add_round(row.num_drafts, int(off[i + 1] - off[i]) - 1)
            if req in done:  # finished in this step: it owns no rows any more
                continue
            if role[i] == CHAIN:
                chained.setdefault(req, {})[row.start] = i
                continue
            rnd = self.rounds.get(req)
            if rnd is None:  # finished while the step ran
                continue
            if role[i] == VERIFY:
                verifying.setdefault(req, []).append(i)
            elif not result.exited[i]:
                rnd.rows = [row.deeper()]
            else:
                rnd.rows = self._after_draft(row, rnd, int(drafts[i]))
        for req, idx in verifying.items():  # a round's verification rows move (and end) together
            rnd = self.rounds[req]
            if not result.exited[idx[0]]:
                rnd.rows = [rows[i].deeper() for i in idx]
                continue
            head = next(i for i in idx if rows[i].index == 0)  # the round's tokens are reported here
            self.trackers[req].update(rows[head].num_drafts, int(off[head + 1] - off[head]) - 1)
            del self.rounds[req]
            self._hold(req)
            keep.append(head)
            inner_rows.append(rnd.plain)
        for req, at in chained.items():
            chain = self.chains.get(req)
            if chain is not None:
                self._move_chain(chain, at, result)
                self._hold(req)
        idx = np.asarray(keep, np.int64)
        if lagged:  # the shape: plain rows' tokens are counted, not known
            tokens = np.zeros(0, np.int64)
        else:
            tok = np.concatenate([np.arange(off[i], off[i + 1]) for i in keep]) if keep else np.zeros(0, np.int64)
            tokens = result.token_ids[tok.astype(np.int64)]
        self.inner.advance(inner_rows, StepResult(result.exited[idx], result.num_tokens[idx], tokens,
                                                  exit_latency=result.exit_latency), done)
        if not lagged and (role == CHAIN).any():  # also the last checks of requests done in this step
            self._verdicts(rows, result, done)

    def on_result(self, rows: Sequence[Row], result: StepResult, done: set[Request]) -> None:
        """A lagged step's values: its chain rows' verdicts (its plain rows moved on at launch)."""
        if getattr(result, "accepted", None) is not None:
            self._verdicts(rows, result, done)

    @staticmethod
    def _move_chain(chain: Chain, at: dict[int, int], result: StepResult) -> None:
        """Move a chain on after a step (``at``: position -> row index of its rows in the step): the
        oldest row, at full depth, leaves (its verdict unconfirmed until read); the others go deeper."""
        oldest = at.get(chain.rows[0].start)
        if oldest is not None and result.exited[oldest]:
            chain.rows.pop(0)
            chain.unconfirmed += 1
        chain.rows = [row.deeper() if row.start in at else row for row in chain.rows]

    def _verdicts(self, rows: Sequence[Row], result: StepResult, done: set[Request]) -> None:
        """Chain rows that reached full depth: each valid one yields one token (the inner policy's
        row moves on with it; the acceptance tracker learns the verdict); a rejection ends the chain
        — its newer rows ran on a wrong token, their checks come back invalid (no token) — and the
        request goes on from the correction."""
        off = result.token_offsets
        for i, row in enumerate(rows):
            if getattr(row, "role", PLAIN) != CHAIN or not result.exited[i]:
                continue
            req = row.request
            lo, hi = int(off[i]), int(off[i + 1])
            if hi > lo:  # a valid check (rows behind an unread rejection yield none)
                self.totals.add_round(1, int(result.accepted[i]))
            chain = self.chains.get(req)
            if chain is None or chain.id != row.chain:
                continue  # the row of a chain that already ended
            chain.unconfirmed -= 1
            if hi > lo and not (req in done or req.finished):
                ok = bool(result.accepted[i])
                self.trackers[req].update(1, int(ok))
                self.inner.advance([chain.plain], StepResult(np.ones(1, bool), np.ones(1, np.int64),
                                                             result.token_ids[lo:hi]), done)
                if not ok:
                    del self.chains[req]
            self._hold(req)

    def _after_draft(self, row: DraftRow, rnd: Round, token: int) -> list[Row]:
        """The round's next rows after a draft row reached depth d: the next draft row, or (after the
        last one) a verification row per position, entering at depth d from the drafts' states."""
        if row.index < row.num_drafts:
            rnd.drafts.append(token)
            return [attrs.evolve(row, start=row.start + 1, depth=0, index=row.index + 1, token=token,
                                 state=self._entry(row.slot, row.start + 1))]
        k, d, start = row.num_drafts, row.draft_loops, rnd.plain.start
        return [VerifyRow(row.request, row.slot, start + i, 1, d, samples=True, in_prompt=False, draft_loops=d,
                          index=i, num_drafts=k, draft=rnd.drafts[i] if i < k else -1,
                          state=self._entry(row.slot, start + i)) for i in range(k + 1)]
