"""The engine thread and its asyncio front end.

:class:`LLMEngine` is not thread-safe, so exactly one thread owns it (:class:`EngineThread`). The
thread blocks on its command queue while the engine is idle; while work exists it drains pending
commands (add / abort / stop) between steps and runs ``step()`` back to back. Results go to the
event loop with ``loop.call_soon_threadsafe`` — outputs, admission results, and a snapshot of the
engine's stats (the only engine state the front end reads; it never calls the engine itself).

:class:`AsyncEngine` is the front end. It admits at most ``capacity`` engine requests at once
(``max_num_seqs + max_queue_len``; each of ``n`` choices counts), rejecting more with
:class:`Overloaded` before anything is queued — the bounded queue that gives back-pressure. A
:class:`Generation` is one HTTP request's set of engine requests (prompts x n); iterating it
yields their outputs as they come; ``abort()`` cancels what is unfinished and so frees its KV.

Delivery cost (issue 10): the thread hands over each step's outputs in one
``call_soon_threadsafe`` callback; that callback appends each output to its generation's buffer
and wakes each waiting consumer at most once per step (no ``asyncio.Queue``, no future per item).
A consumer takes everything buffered at once (:meth:`Generation.batches`), so one that fell behind
handles several steps' outputs in one wakeup.

Faults: a failure inside ``step()`` is handled by the engine itself (it aborts that step's requests
with the error recorded). Anything else that escapes ``step()`` is caught here: the requests the
step was running are aborted with an error, the fault is logged and counted, and the loop goes on.
Only if the thread itself dies does the front end fail every request and report itself dead.

Watchdog: from the stats snapshots the thread publishes (``num_steps``, ``num_waiting``,
``num_running``) and its own count of requests in flight, the front end notices when requests
are waiting while no step has run for ``watchdog_timeout`` seconds (a step that never returns, or
an engine that can no longer admit anything); ``stall_reason`` then says so and ``/health``
answers 503, so an orchestrator restarts a server that would otherwise look healthy for ever.

Must not: touch the engine from the event loop, or block the event loop on the engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable, Sequence

import attrs

from rlt.platform.engine.engine import EngineStats, LLMEngine
from rlt.platform.outputs import RequestOutput
from rlt.platform.sampling_params import SamplingParams
from rlt.serve.errors import EngineDead, Overloaded, new_error_id

log = logging.getLogger("rlt.serve.engine")


# -- commands to the engine thread --------------------------------------------------------------
@attrs.frozen
class _NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    future: Any  # asyncio.Future resolved on the loop with None or the admission error


@attrs.frozen
class _Add:
    """Admit the engine requests of one HTTP request all-or-nothing, in one pass between two steps."""

    requests: tuple[_NewRequest, ...]


@attrs.frozen
class _Abort:
    request_id: str


@attrs.frozen
class _Stop:
    pass


@attrs.frozen
class _Describe:
    """Ask for ``engine.describe()`` computed on the engine thread (between steps: the counters it
    reads are the engine thread's); ``reply(value_or_exception)`` is called there."""

    reply: Callable[[Any], None]


@attrs.frozen
class Delivery:
    """What the engine thread hands to the loop after processing commands or a step."""

    outputs: tuple[RequestOutput, ...]
    #: request id -> error message, for requests the engine could not even abort cleanly
    failed: tuple[tuple[str, str], ...]
    stamp: float
    stats: EngineStats
    thread_faults: int


class EngineThread(threading.Thread):
    def __init__(self, engine: LLMEngine, deliver: Callable[[Delivery], None],
                 admitted: Callable[[Any, str, BaseException | None], None],
                 died: Callable[[str], None]) -> None:
        super().__init__(name="rlt-engine", daemon=True)
        self.engine = engine
        self._deliver = deliver
        self._admitted = admitted
        self._died = died
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: set[str] = set()
        self.thread_faults = 0
        self.latest_stats: EngineStats = engine.stats()
        self.dead_reason: str | None = None

    def submit(self, command) -> None:
        self._commands.put(command)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._loop()
        except BaseException:  # noqa: BLE001 - the thread must report its death, whatever it is
            error_id = new_error_id()
            log.exception("engine thread died [error id %s]", error_id)
            self.dead_reason = f"engine thread died (error id {error_id}; the server log has the details)"
            self._died(self.dead_reason)

    def _loop(self) -> None:
        engine = self.engine
        while True:
            commands = [] if engine.has_unfinished_requests() else [self._commands.get()]
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            outputs: list[RequestOutput] = []
            failed: list[tuple[str, str]] = []
            stop = False
            for cmd in commands:
                if isinstance(cmd, _Add):
                    self._add(cmd.requests)
                elif isinstance(cmd, _Abort):
                    self._abort(cmd.request_id, outputs, failed, None)
                elif isinstance(cmd, _Stop):
                    stop = True
                elif isinstance(cmd, _Describe):
                    try:
                        cmd.reply(engine.describe())
                    except Exception as exc:  # noqa: BLE001 - reported to the caller, the engine goes on
                        cmd.reply(exc)
            if stop:
                for rid in sorted(self._live):
                    self._abort(rid, outputs, failed, None)
                self._publish(outputs, failed)
                return
            if engine.has_unfinished_requests():
                outputs.extend(self._step(failed))
            if outputs or failed or commands:
                self._publish(outputs, failed)
            else:
                self.latest_stats = engine.stats()

    def _add(self, requests: tuple[_NewRequest, ...]) -> None:
        """Add ``requests`` or none of them: one the engine refuses withdraws those added before it (no step
        ran in between, so they computed nothing) and fails the group with its error."""
        added: list[str] = []
        error: BaseException | None = None
        for r in requests:
            try:
                self.engine.add_request(r.request_id, r.prompt_token_ids, r.params)
            except Exception as exc:  # noqa: BLE001 - InvalidRequestError, or a defect: reported either way
                error = exc
                break
            added.append(r.request_id)
        for rid in added:
            if error is None:
                self._live.add(rid)
                continue
            try:
                self.engine.abort_request(rid)  # its output has no route left: never delivered
            except Exception:  # noqa: BLE001 - then it runs to its end unseen; stop() still aborts it
                log.exception("withdrawing %s failed", rid)
                self._live.add(rid)
        for r in requests:
            self._admitted(r.future, r.request_id, error)

    def _step(self, failed: list[tuple[str, str]]) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a fault outside the engine's own guard: contain it
            self.thread_faults += 1
            message = f"engine fault: {type(exc).__name__}: {exc}"
            running = self.engine.running_request_ids()
            log.exception("engine step failed outside its guard; aborting %d running request(s)", len(running))
            outputs: list[RequestOutput] = []
            for rid in running:
                self._abort(rid, outputs, failed, message)
            return outputs

    def _abort(self, rid: str, outputs: list, failed: list, error: str | None) -> None:
        try:
            out = self.engine.abort_request(rid)
        except Exception as exc:  # noqa: BLE001 - the request is lost; tell its client
            log.exception("aborting %s failed", rid)
            self._live.discard(rid)
            failed.append((rid, error or f"engine fault while aborting: {type(exc).__name__}: {exc}"))
            return
        if out is not None:
            outputs.append(attrs.evolve(out, error=error) if error and out.error is None else out)

    def _publish(self, outputs: list[RequestOutput], failed: list[tuple[str, str]]) -> None:
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        stats = self.engine.stats()
        self.latest_stats = stats
        self._deliver(Delivery(tuple(outputs), tuple(failed), time.monotonic(), stats, self.thread_faults))


# -- the asyncio side -------------------------------------------------------------------------------
@attrs.frozen
class Item:
    """One output of one choice of a :class:`Generation` (``error`` set when the engine failed it)."""

    index: int
    request_id: str
    output: RequestOutput | None
    stamp: float
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or (self.output is not None and self.output.finished)


@attrs.define(eq=False)
class _Route:
    sink: "Generation"
    index: int
    timer: Any  # metrics.RequestTimer


class Watchdog:
    """Tells when work is waiting but no engine step has run for ``timeout`` seconds.

    Fed observations (steps so far, whether anything waits or runs) with their time; progress is
    any change of the step count, and an idle engine is never stalled."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._steps: int | None = None
        self._since = time.monotonic()
        self._busy = False
        self.warned = False

    def observe(self, num_steps: int, busy: bool, now: float) -> None:
        if not busy or num_steps != self._steps:
            self._steps, self._since = num_steps, now
            self.warned = False
        self._busy = busy

    def stalled_for(self, now: float) -> float | None:
        """Seconds without a step while busy, once past the timeout; else None."""
        if self.timeout <= 0 or not self._busy:
            return None
        idle = now - self._since
        return idle if idle >= self.timeout else None


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, capacity: int, retry_after: int = 1, metrics=None,
                 watchdog_timeout: float = 0.0) -> None:
        self.engine = engine
        self.capacity = capacity
        self.retry_after = retry_after
        self.metrics = metrics
        self.watchdog = Watchdog(watchdog_timeout)
        self._ticker: asyncio.Task | None = None
        self.in_flight = 0
        self._routes: dict[str, _Route] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: EngineThread | None = None
        self._dead: str | None = None
        self._stopping = False

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = EngineThread(self.engine, self._deliver_threadsafe, self._admitted_threadsafe,
                                    self._died_threadsafe)
        self._thread.start()
        if self.watchdog.timeout > 0:
            self._ticker = asyncio.ensure_future(self._tick(min(1.0, self.watchdog.timeout / 4)))

    async def _tick(self, interval: float) -> None:
        while True:
            self._watch()
            await asyncio.sleep(interval)

    def _watch(self) -> None:
        st = self.stats()
        busy = self.in_flight > 0 or st.num_running > 0 or st.num_waiting > 0
        self.watchdog.observe(st.num_steps, busy, time.monotonic())

    @property
    def stall_reason(self) -> str | None:
        """Why the engine counts as stalled (requests wait, no step for --watchdog-timeout s), or None."""
        self._watch()
        idle = self.watchdog.stalled_for(time.monotonic())
        if idle is None:
            return None
        st = self.stats()
        reason = (f"no engine step for {idle:.0f} s while requests wait (running {st.num_running}, waiting "
                  f"{st.num_waiting}, in flight {self.in_flight}; --watchdog-timeout {self.watchdog.timeout:g})")
        if not self.watchdog.warned:
            self.watchdog.warned = True
            log.error("engine stalled: %s", reason)
        return reason

    async def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is still running, and join the engine thread."""
        self._stopping = True
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        thread.submit(_Stop())
        await asyncio.to_thread(thread.join, timeout)
        await asyncio.sleep(0)  # let the last delivery run
        if thread.is_alive():
            log.error("engine thread did not stop within %.0f s", timeout)

    def begin_shutdown(self, grace: float) -> None:
        """Refuse new requests from now on, and abort the in-flight ones after ``grace`` seconds
        (their clients then get a normal end with ``finish_reason: "abort"``)."""
        if self._stopping:
            return
        self._stopping = True
        assert self._loop is not None
        self._loop.call_later(max(0.0, grace), self.abort_all)

    def abort_all(self) -> None:
        if self._routes:
            log.warning("aborting %d in-flight request(s) at shutdown", len(self._routes))
        for rid in list(self._routes):
            self.abort(rid)

    @property
    def alive(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        if self._dead is not None:
            return self._dead
        if self._thread is None:
            return "engine thread not started"
        if not self._thread.is_alive():
            return self._thread.dead_reason or "engine thread stopped"
        return None

    def stats(self) -> EngineStats:
        return self._thread.latest_stats if self._thread is not None else self.engine.stats()

    async def describe(self, timeout: float = 5.0) -> dict | None:
        """``engine.describe()`` as of now (executor step counts, fallbacks, pipeline), computed on
        the engine thread between steps; None if that thread does not answer within ``timeout``
        (a stalled or dead engine)."""
        if self._thread is None or self._dead is not None:
            return None
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(value) -> None:
            if not future.done():
                future.set_result(value)

        self._thread.submit(_Describe(lambda value: self._call(settle, value)))
        try:
            value = await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            return None
        return None if isinstance(value, BaseException) else value

    @property
    def thread_faults(self) -> int:
        return self._thread.thread_faults if self._thread is not None else 0

    # -- thread -> loop ------------------------------------------------------------------------------
    def _call(self, fn, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed meanwhile (shutdown)
            pass

    def _deliver_threadsafe(self, d: Delivery) -> None:
        self._call(self._deliver, d)

    def _admitted_threadsafe(self, future, request_id: str, error) -> None:
        self._call(self._admitted, future, request_id, error)

    def _died_threadsafe(self, reason: str) -> None:
        self._call(self._fail_all, reason)

    def _admitted(self, future: asyncio.Future, request_id: str, error: BaseException | None) -> None:
        if error is not None:
            self._drop(request_id)
        elif self.metrics is not None and request_id in self._routes:
            self.metrics.on_admitted(self._routes[request_id].timer)
        if not future.done():
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    def _drop(self, request_id: str) -> _Route | None:
        route = self._routes.pop(request_id, None)
        if route is not None:
            self.in_flight -= 1
        return route

    def _deliver(self, d: Delivery) -> None:
        for out in d.outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            if self.metrics is not None:
                self.metrics.on_output(route.timer, out, d.stamp)
            route.sink.put(Item(route.index, out.request_id, out, d.stamp))
            if out.finished:
                self._drop(out.request_id)
        for rid, message in d.failed:
            route = self._drop(rid)
            if route is not None:
                if self.metrics is not None:
                    self.metrics.on_failed(route.timer)
                route.sink.put(Item(route.index, rid, None, d.stamp, message))
        if self.metrics is not None:
            self.metrics.on_stats(d.stats, d.thread_faults)

    def _fail_all(self, reason: str) -> None:
        self._dead = reason
        now = time.monotonic()
        for rid in list(self._routes):
            route = self._drop(rid)
            if self.metrics is not None:
                self.metrics.on_failed(route.timer)
            route.sink.put(Item(route.index, rid, None, now, reason))

    # -- requests ----------------------------------------------------------------------------------------
    def _reserve(self, n: int) -> None:
        if not self.alive or self._stopping:
            raise EngineDead(self.dead_reason or "the server is shutting down", None)
        if self.in_flight + n > self.capacity:
            raise Overloaded(
                f"server is at capacity: {self.in_flight} request(s) in flight, limit {self.capacity} "
                f"(--max-num-seqs + --max-queue-len); this request needs {n}. Retry later.", self.retry_after)

    def abort(self, request_id: str) -> None:
        if request_id in self._routes and self._thread is not None:
            self._thread.submit(_Abort(request_id))

    async def generate(self, requests: Sequence[tuple[int, str, list[int], SamplingParams]],
                       arrival: float | None = None) -> "Generation":
        """Admit ``(index, request_id, prompt_token_ids, params)`` requests all-or-nothing.

        Raises :class:`Overloaded` when they do not fit, the engine's ``InvalidRequestError`` when
        it rejects one (then none run), or :class:`EngineDead`.
        """
        self._reserve(len(requests))
        gen = Generation(self, [r[1] for r in requests])
        arrival = time.monotonic() if arrival is None else arrival
        futures, adds = [], []
        assert self._thread is not None and self._loop is not None
        clash = [r[1] for r in requests if r[1] in self._routes]
        if clash:
            raise ValueError(f"request id {clash[0]} is already in flight")
        for index, rid, ids, params in requests:
            timer = self.metrics.timer(arrival, len(ids)) if self.metrics is not None else None
            self._routes[rid] = _Route(gen, index, timer)
            self.in_flight += 1
            fut = self._loop.create_future()
            futures.append(fut)
            adds.append(_NewRequest(rid, list(ids), params, fut))
        self._thread.submit(_Add(tuple(adds)))
        try:
            results = await asyncio.gather(*futures, return_exceptions=True)
        except asyncio.CancelledError:
            gen.abort()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            gen.abort()
            raise errors[0]
        return gen


class Generation:
    """The engine requests of one HTTP request; iterate for their outputs, ``abort()`` to cancel.

    Outputs are buffered on the event loop by :meth:`put`; the consumer is woken at most once per
    engine step however many of its outputs that step produced."""

    def __init__(self, front: AsyncEngine, request_ids: list[str]) -> None:
        self._front = front
        self._buffer: list[Item] = []
        self._waiter: asyncio.Future | None = None
        self.request_ids = list(request_ids)
        self._pending = set(request_ids)
        self._aborted = False

    @property
    def done(self) -> bool:
        return not self._pending

    def put(self, item: Item) -> None:
        """Buffer ``item`` and wake the consumer if it waits (event loop only)."""
        self._buffer.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def abort(self) -> None:
        """Cancel every unfinished engine request (idempotent); their KV is freed by the engine."""
        if self._aborted:
            return
        self._aborted = True
        for rid in self.request_ids:
            if rid in self._pending:
                self._front.abort(rid)

    async def batches(self) -> AsyncIterator[list[Item]]:
        """Everything delivered since the last batch, in order, until every request has finished."""
        while self._pending:
            if not self._buffer:
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            batch, self._buffer = self._buffer, []
            for item in batch:
                if item.finished:
                    self._pending.discard(item.request_id)
            yield batch

    async def __aiter__(self) -> AsyncIterator[Item]:
        async for batch in self.batches():
            for item in batch:
                yield item
