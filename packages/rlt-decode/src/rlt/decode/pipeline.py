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

Owns: the in-flight queue. Must not: free anything itself (the core does) or wait on the device
outside completing a step.
"""

from __future__ import annotations

from collections import deque

from rlt.decode.batch import decode_only
from rlt.platform.engine.interfaces import StepPlan


class PipelinedStepLoop:
    def __init__(self, *, depth: int, stats, max_rows: int, drain_every_step: str = "") -> None:
        if depth < 0:
            raise ValueError(f"--pipeline-depth must be >= 0, got {depth}")
        self.depth = depth
        self.stats = stats
        self.max_rows = max_rows
        #: why every step runs synchronously (drained before planning), or ""
        self.drain_every_step = drain_every_step
        self._in_flight: deque = deque()
        stats.depth = 0 if drain_every_step else depth
        stats.off_reason = drain_every_step

    # -- the step loop ------------------------------------------------------------------------
    def step(self, core) -> list:
        outputs = []
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
                outputs += core.complete(self._in_flight.popleft(), advanced=True)
            self.stats.launched(len(self._in_flight))
            return outputs + core.take_outputs()
        launched = core.launch(StepPlan(rows))
        shape = getattr(launched.handle, "shape", None) if launched.error is None else None
        if shape is None:  # synchronous (or failed): everything launched before it completes first
            self.stats.sync_reasons[self._why_sync(launched)] += 1
            outputs += self._drain(core, "before a synchronous step")
            outputs += core.complete(launched)
            self.stats.launched(0)
            return outputs
        core.advance_launched(launched, shape)
        self._in_flight.append(launched)
        limit = 0 if self.drain_every_step else self.depth
        while len(self._in_flight) > limit:
            outputs += core.complete(self._in_flight.popleft(), advanced=True)
        self.stats.launched(len(self._in_flight))
        return outputs + core.take_outputs()

    def drain(self, core) -> list:
        return self._drain(core, "drain") + core.take_outputs()

    # -- helpers ----------------------------------------------------------------------------------
    @staticmethod
    def _live(rows) -> tuple:
        """Rows worth launching: not of a finished request, nor of one whose last token
        (``max_tokens``) is already in flight."""
        return tuple(r for r in rows if not r.request.finished and r.request.num_produced < r.request.max_tokens)

    def _drain(self, core, reason: str) -> list:
        outputs = []
        if self._in_flight and reason:
            self.stats.drains[reason] += 1
        while self._in_flight:
            outputs += core.complete(self._in_flight.popleft(), advanced=True)
        return outputs

    @staticmethod
    def _why_sync(launched) -> str:
        if launched.error is not None:
            return "step failed"
        if type(launched.batch).__name__ != "DecodeBatch":
            return "not a decode-only step"
        return "a row may exit on the gate"
