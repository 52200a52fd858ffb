"""The token-level pipeline: a step loop that keeps decode steps in flight and reads their tokens
back with a bounded lag.

Each ``step(core)`` plans one step and launches it. A *lagged* step (a decode-only batch whose
exits are all known on the host: fixed depth, or no row able to exit on the gate this loop) has
its rows moved on at once (``core.advance_launched``: the tokens count as pending, positions and
seeds advance) and joins the in-flight queue; the oldest steps are completed — tokens recorded,
detokenized, stop strings and stop ids applied, finished requests freed — once more than
``depth`` are in flight, so the host's output work for step N overlaps the device's work on
steps N+1…N+depth. The next step's depth-0 rows take their token from the executor's device
token buffer while it is in flight.

Synchronous steps (a row consults the gate, or any step the static builder does not build:
prompt chunks, other features' rows) are launched, then everything in flight is completed
before them, in order. A step that cannot be built while tokens are pending (its builder reads
them from the requests: a prompt chunk or another feature's row next to a pending request) first
drains the pipeline. Requests that reached ``max_tokens`` in flight are not scheduled again
(host-deterministic); a request that stopped on a token read late (stop id, EOS, stop string)
may have had rows launched after its stop: they are never emitted (the request is finished when
their step is completed, and the core skips finished requests), and they wrote KV only into the
request's own pages, freed after they were launched (stream order keeps a new owner's writes
after them). With preemption on, the loop drains before every plan (a preempted request is
rebuilt from recorded tokens) and runs synchronously.

**Device-planned steps** (``--pipeline-device-exit``): a decode step of plain rows where a row may
exit on the gate is *open* — launched without reading its exits, every row sampled, exits and
tokens read back with the lag (:class:`rlt.decode.readback.OpenStep`). While the host could plan
nothing but the same rows moved on — no request of the run finished or was aborted, none can be
admitted (no request waiting, no free slot, or the waiting ones blocked on the step budget or KV
blocks since the run began, none arrived since), every running request is in the run (none waits
for a prompt chunk or a verdict), none can reach ``max_tokens`` within the steps in flight — the
next step is planned on the device from the exit mask
(``executor.continue_open``: a row that exited moves to its next position at depth 0, the others
one loop deeper), so adaptive exit no longer makes steps synchronous. The host's own bookkeeping
follows when each step is completed, in order: the rows of a device-planned step are the
scheduler's rows after the previous step was applied (``rows_of``), and the device's depth and
position of every row must equal them (else the step is an engine fault). Seeds and min_tokens use
device-side generated counts. When the run must end, everything in flight is completed and the
host plans again (counted by reason in ``device_exit.ends``).

Owns: the in-flight queue, the current run of open steps. Must not: free anything itself (the
core does) or wait on the device outside completing a step.
"""

from __future__ import annotations

from collections import deque

import attrs
import numpy as np

from rlt.decode.batch import decode_only
from rlt.platform.engine.core import Launched
from rlt.platform.engine.interfaces import Row, StepPlan


@attrs.define(eq=False)
class _Run:
    """A run of open steps: the host-planned first one and those the device planned after it.
    Row i of every step of the run is request i's."""

    requests: tuple
    #: the first step's rows (row i = request i): whom a fault in a device-planned step aborts
    fault_rows: tuple
    #: requests waiting when the host planned the first step, and whether the policy then said why
    #: they could not be admitted (``blocked_reason``: the step budget or KV blocks, which only a
    #: finish, ending the run anyway, changes)
    waiting: int = 0
    blocked: bool = False
    open: int = 0  # steps of the run launched and not completed
    steps: int = 0  # steps launched


class _Resolved:
    """A handle whose result is computed when read (an open step's rows, named by the host)."""

    def __init__(self, read) -> None:
        self._read = read

    def done(self) -> bool:
        return True

    def result(self):
        return self._read()


class PipelinedStepLoop:
    def __init__(self, *, depth: int, stats, max_rows: int, drain_every_step: str = "") -> None:
        if depth < 0:
            raise ValueError(f"--pipeline-depth must be >= 0, got {depth}")
        self.depth = depth
        self.stats = stats
        self.max_rows = max_rows
        #: why every step runs synchronously (drained before planning), or ""
        self.drain_every_step = drain_every_step
        #: launched steps not completed yet: (launched, None) for a lagged one, (launched, (run, k))
        #: for the k-th step of a run of open steps
        self._in_flight: deque = deque()
        self._run: _Run | None = None
        stats.depth = 0 if drain_every_step else depth
        stats.off_reason = drain_every_step

    # -- the step loop ------------------------------------------------------------------------
    def step(self, core) -> list:
        outputs = []
        if self._run is not None:
            why = self._run_ends(core)
            if not why:
                return self._continue(core)
            self.stats.device_planning_ends[why] += 1
            outputs += self._drain(core, "")
        if self.drain_every_step and self._in_flight:
            outputs += self._drain(core, "preemption")
        plan = core.plan()
        rows = self._live(plan.rows)
        if rows and self._in_flight and any(r.request.num_pending for r in rows) \
                and not decode_only(rows, self.max_rows):
            outputs += self._drain(core, "non-decode step with tokens in flight")
            rows = self._live(rows)
        if not rows:  # nothing to launch: let the oldest step in flight finish
            if self._in_flight:
                outputs += self._complete(core, self._in_flight.popleft())
            self.stats.launched(len(self._in_flight))
            return outputs + core.take_outputs()
        launched = core.launch(StepPlan(rows))
        handle = launched.handle if launched.error is None else None
        if getattr(handle, "opens_run", False):  # exits read later; the device may plan what follows
            s = core.scheduler
            rows = launched.batch.rows
            self._run = _Run(tuple(r.request for r in rows), rows, s.num_waiting, s.blocked_reason is not None)
            return outputs + self._push(core, launched, self._run)
        shape = getattr(handle, "shape", None)
        if shape is None:  # synchronous (or failed): everything launched before it completes first
            self.stats.sync_reasons[self._why_sync(launched)] += 1
            outputs += self._drain(core, "before a synchronous step")
            outputs += core.complete(launched)
            self.stats.launched(0)
            return outputs
        core.advance_launched(launched, shape)
        return outputs + self._push(core, launched, None)

    def drain(self, core) -> list:
        return self._drain(core, "drain") + core.take_outputs()

    # -- runs of open steps -------------------------------------------------------------------------
    def _run_ends(self, core) -> str:
        """Why the current run of open steps cannot go on with a device-planned step ("" if it can)."""
        run = self._run
        if any(r.finished for r in run.requests):
            return "a request finished"
        s = core.scheduler
        if not hasattr(s, "rows_of"):  # the rows of a device-planned step are named through it
            return "the scheduler policy has no rows_of"
        if s.num_running != len(run.requests):  # e.g. a prompt chunk or a speculative verdict due
            return "a running request is not in the run"
        if s.num_waiting and s.num_running < core.ctx.max_num_seqs \
                and not (run.blocked and s.num_waiting == run.waiting):  # blocked, and nobody new
            return "a request can be admitted"
        if any(r.num_produced + run.open >= r.max_tokens for r in run.requests):
            return "a request may reach max_tokens in flight"
        return ""

    def _continue(self, core) -> list:
        run = self._run
        launched = core.launch_planned(run.fault_rows, core.executor.continue_open)
        return self._push(core, launched, run) + core.take_outputs()

    def _push(self, core, launched, run: _Run | None) -> list:
        """Queue a launched step; complete the oldest ones beyond the depth."""
        if run is not None:
            self._in_flight.append((launched, (run, run.steps)))
            run.open += 1
            run.steps += 1
        else:
            self._in_flight.append((launched, None))
        outputs = []
        limit = 0 if self.drain_every_step else self._depth_now(core)
        while len(self._in_flight) > limit:
            outputs += self._complete(core, self._in_flight.popleft())
        self.stats.launched(len(self._in_flight))
        return outputs

    def _depth_now(self, core) -> int:
        """Steps kept in flight now: the depth, or fewer while the policy asks (``max_in_flight``: e.g. an
        open speculative chain, whose verdicts are read that many steps late)."""
        ask = getattr(core.scheduler, "max_in_flight", None)
        return self.depth if ask is None else min(self.depth, ask)

    def _complete(self, core, entry) -> list:
        launched, place = entry
        if place is None:
            return core.complete(launched, advanced=True)
        run, k = place
        run.open -= 1
        live = [i for i, r in enumerate(run.requests) if not r.finished]
        if launched.error is not None:
            return core.complete(attrs.evolve(launched, rows=tuple(launched.rows[i] for i in live)))
        if k == 0:  # the host planned it
            rows = [launched.rows[i] for i in live]
        else:  # the scheduler's rows now, after the steps before it were applied: what the device ran
            try:
                rows = [self._decode_row(core, run.requests[i]) for i in live]
            except Exception as exc:  # noqa: BLE001 - an engine fault for this step's requests
                launched.handle.release()
                return core.complete(Launched(tuple(launched.rows[i] for i in live), None, None, exc))
        index = np.asarray(live, np.int64)
        depth = np.fromiter((r.depth for r in rows), np.int32, len(rows))
        position = np.fromiter((r.start for r in rows), np.int64, len(rows))
        if not rows:  # every request of the step finished before it was read: only free its ring entry
            launched.handle.release()
            return []
        read = (lambda: launched.handle.result_rows(index, depth, position))
        b = launched.batch
        batch = attrs.evolve(b, rows=tuple(rows), slots=b.slots[index], depth=depth.astype(np.int64),
                             row_start=position, fixed_exit=b.fixed_exit[index], adaptive=b.adaptive[index],
                             samples=b.samples[index], from_device=b.from_device[index])
        return core.complete(Launched(tuple(rows), batch, _Resolved(read)))

    # -- helpers ----------------------------------------------------------------------------------
    @staticmethod
    def _live(rows) -> tuple:
        """Rows worth launching: not of a finished request, nor of one whose last token
        (``max_tokens``) is already in flight."""
        return tuple(r for r in rows if not r.request.finished and r.request.num_produced < r.request.max_tokens)

    @staticmethod
    def _decode_row(core, request) -> Row:
        mine = core.scheduler.rows_of(request)
        if len(mine) != 1 or type(mine[0]) is not Row or mine[0].in_prompt or mine[0].length != 1:
            raise RuntimeError(f"a device-planned step's request {request.request_id} has rows {mine!r}; "
                               "expected one decode row")
        return mine[0]

    def _drain(self, core, reason: str) -> list:
        outputs = []
        if self._in_flight and reason:
            self.stats.drains[reason] += 1
        while self._in_flight:
            outputs += self._complete(core, self._in_flight.popleft())
        self._run = None
        return outputs

    @staticmethod
    def _why_sync(launched) -> str:
        if launched.error is not None:
            return "step failed"
        if type(launched.batch).__name__ != "DecodeBatch":
            return "not a decode-only step"
        return "a row may exit on the gate"
