"""EngineCore: the step loop's building blocks over the assembled components.

``plan()`` asks the scheduler policy for a step (admissions that failed are answered with their
error); ``launch(plan)`` builds the batch and hands it to the executor; ``complete(launched)``
waits for the result, records produced tokens through the output processor, finishes requests
(freeing slot, KV and executor state), advances the rows and calls the step observers. The step
loop component decides how these are sequenced (:class:`SyncStepLoop`: one step per call).

A pipelined step loop whose step's shape (which rows exit, how many tokens each produces) is
known on the host at launch calls ``advance_launched(launched, shape)`` right after launching —
the rows move on and the produced tokens are counted as pending (``Request.num_pending``) — and
later ``complete(launched, advanced=True)`` when the token values arrive: the shape's counts
leave ``num_pending``, the values are recorded, and the policy's optional ``on_result`` sees them.
A row may report tokens the shape did not count (a lagged speculative check: its token is known
to exist only once read) or fewer than it counted (tokens discarded on the device). A step the
device planned from the one before (``launch_planned``) is completed like a synchronous one, with
the rows the host has planned by then.

Faults: an exception while building, executing or completing a step aborts the requests of that
step with the error in their outputs, frees their resources, is counted, and the engine stays up.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import attrs

from rlt.platform.engine import prompt_logprobs
from rlt.platform.engine.interfaces import Row, StepPlan, StepResult
from rlt.platform.engine.output_processor import OutputProcessor
from rlt.platform.engine.request import Request, RequestStatus
from rlt.platform.outputs import RequestOutput

log = logging.getLogger("rlt.engine")


@attrs.frozen(eq=False)
class Launched:
    rows: tuple[Row, ...]
    batch: Any
    handle: Any
    error: BaseException | None = None


class SyncStepLoop:
    """The base step loop: plan, launch and complete one step per call (nothing in flight after)."""

    def step(self, core: "EngineCore") -> list[RequestOutput]:
        plan = core.plan()
        if not plan.rows:
            return core.take_outputs()
        return core.complete(core.launch(plan))

    def drain(self, core: "EngineCore") -> list[RequestOutput]:
        return core.take_outputs()


class EngineCore:
    def __init__(self, ctx, outputs: OutputProcessor) -> None:
        p = ctx.parts
        self.ctx = ctx
        self.scheduler = p.scheduler
        self.builder = p.batch_builder
        self.executor = p.executor
        self.slots = p.slots
        self.out = outputs
        self.observers: list = []
        self.requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []
        self.num_steps = 0
        self.num_faults = 0

    # -- requests -----------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.scheduler.add(req)  # may veto (InvalidRequestError): then nothing was recorded
        self.requests[req.request_id] = req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        self._finish(req, "abort")
        return self._final(req)

    def take_outputs(self) -> list[RequestOutput]:
        out, self._pending = self._pending, []
        return out

    def _finish(self, req: Request, reason: str) -> None:
        running = req.status is RequestStatus.RUNNING
        slot = req.slot
        if running and self.ctx.platform.sync_before_reuse:
            self.ctx.platform.synchronize()  # the device may still read this slot's pages and metadata
        self.out.finish(req, reason)
        self.scheduler.finish(req)
        if running:
            self.executor.release(slot)

    def _final(self, req: Request) -> RequestOutput:
        self.requests.pop(req.request_id, None)
        return self.out.output(req, True)

    def _fail(self, requests, message: str) -> list[RequestOutput]:
        outputs = []
        for req in requests:
            req.error = message
            if req.finished:  # failed at admission: the scheduler already gave its resources back
                self.out.finish(req, "abort")
            else:
                self._finish(req, "abort")
            outputs.append(self._final(req))
        return outputs

    # -- steps ------------------------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        plan = self.scheduler.schedule()
        for req, exc in plan.failed:
            log.error("admission of %s failed: %s: %s", req.request_id, type(exc).__name__, exc)
            self._pending.extend(self._fail([req], f"admission failed: {type(exc).__name__}: {exc}"))
        return plan

    def launch(self, plan: StepPlan) -> Launched:
        self.num_steps += 1
        try:
            batch = self.builder.build(plan.rows)
            return Launched(plan.rows, batch, self.executor.execute(batch))
        except Exception as exc:  # noqa: BLE001 - an engine fault: complete() aborts the step's requests
            return Launched(plan.rows, None, None, exc)

    def launch_planned(self, rows: Sequence[Row], run) -> Launched:
        """Launch a step whose batch the device planned: ``run()`` builds and executes it and returns
        ``(batch, handle)`` (rlt-decode's device-planned decode steps, which follow an open step
        without a host plan). ``rows`` name the requests a fault aborts. Counted and
        fault-captured like :meth:`launch`."""
        self.num_steps += 1
        try:
            batch, handle = run()
            return Launched(tuple(rows), batch, handle)
        except Exception as exc:  # noqa: BLE001 - an engine fault: complete() aborts the step's requests
            return Launched(tuple(rows), None, None, exc)

    def advance_launched(self, launched: Launched, shape: StepResult) -> None:
        """Move the rows of a launched step on before its tokens are read (a pipelined loop).

        ``shape`` gives ``exited`` and ``num_tokens`` per row in batch order (token values are
        not read). Produced tokens become pending; the sampler's per-slot step counts include
        them. A request whose produced count reaches ``max_tokens`` is not advanced (it has no
        further rows: the loop must not schedule it again; it finishes when its tokens are read).
        """
        done: set[Request] = set()
        rows = launched.batch.rows
        for row, produced in zip(rows, shape.num_tokens):
            req = row.request
            if produced and not req.finished:
                req.num_pending += int(produced)
                self.slots.num_generated[row.slot] = req.num_produced
                if req.num_produced >= req.max_tokens:
                    done.add(req)
        self.scheduler.advance(rows, shape, done)

    def complete(self, launched: Launched, advanced: bool = False) -> list[RequestOutput]:
        """Read a launched step's result and record it; ``advanced``: its rows were already moved
        on by :meth:`advance_launched`."""
        outputs = self.take_outputs()
        error = launched.error
        if error is None:
            try:
                result = launched.handle.result()
                shape = launched.handle.shape if advanced else None
                outputs.extend(self._apply(launched.batch.rows, result, shape))
            except Exception as exc:  # noqa: BLE001
                error = exc
        if error is not None:
            self.num_faults += 1
            reqs = list(dict.fromkeys(r.request for r in launched.rows))
            log.error("engine step failed; aborting %d request(s)", len(reqs), exc_info=error)
            outputs.extend(self._fail(reqs, f"engine fault: {type(error).__name__}: {error}"))
            return outputs
        for obs in self.observers:
            obs.on_step(launched.batch, result)
        return outputs

    def _apply(self, rows, result, shape: StepResult | None = None) -> list[RequestOutput]:
        """Record ``result``; ``shape``: the rows were advanced at launch with it (a lagged step)."""
        now = time.monotonic()
        off = result.token_offsets
        outputs: list[RequestOutput] = []
        done: set[Request] = set()
        for i, row in enumerate(rows):
            req = row.request
            prompt_logprobs.collect(req, result.prompt_logprobs.get(i))
            lo, hi = int(off[i]), int(off[i + 1])
            if shape is not None:
                req.num_pending -= int(shape.num_tokens[i])  # counted at launch; recorded (or discarded) now
            if hi == lo or req in done or req.finished:
                continue
            reason = None
            for k in range(lo, hi):
                top = ()
                if req.params.logprobs and result.top_ids is not None:
                    n = req.params.logprobs
                    top = tuple(zip(result.top_ids[k, :n].tolist(), result.top_logprobs[k, :n].tolist()))
                lp = None if result.logprobs is None else result.logprobs[k]
                reason = self.out.append(req, int(result.token_ids[k]), row.depth + 1, lp, top, now)
                if reason is not None:
                    break
            self.slots.num_generated[row.slot] = req.num_produced
            if reason is not None:
                self._finish(req, reason)
                done.add(req)
                outputs.append(self._final(req))
            else:
                outputs.append(self.out.output(req, False))
        if shape is None:
            self.scheduler.advance(rows, result, done)
        else:
            on_result = getattr(self.scheduler, "on_result", None)
            if on_result is not None:
                on_result(rows, result, done)
        return outputs
