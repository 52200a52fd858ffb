"""Lagged readback of sampled tokens: a pinned ring of host buffers, the handle of a lagged step,
and the pipeline's counters.

A lagged decode step's sampled tokens (and logprobs) are copied device → host with non-blocking
copies into a :class:`PinnedRing` entry, behind an event recorded on the engine's stream; the
step's :class:`LaggedStep` handle knows its *shape* (which rows exited, how many tokens each
produced) on the host at launch, and its token values once the event has completed. An entry is
reused only after the step that filled it was consumed (its values copied out).

An *open* step (a row may exit on the gate: its shape is not host-known) copies its exit mask and
each row's depth and position as well; its :class:`OpenStep` handle gives the result of the rows
the host names when it has planned them (rlt-decode's device-planned steps, :mod:`rlt.decode.pipeline`).

Owns: the ring's pinned buffers and events, :class:`PipelineStats`. Must not: wait on the device
anywhere but :meth:`LaggedStep.result` / :meth:`OpenStep.result_rows` (which count the wait when it
really blocks).
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np
import torch

from rlt.platform.engine.interfaces import StepResult


class PipelineStats:
    """Host syncs per step and in-flight depth, for ``describe()`` (``/v1/engine``).

    ``host_syncs`` counts blocking device → host reads on the engine thread: a synchronous step
    reads its exit mask (when a row consults the gate) and its tokens; a lagged step reads
    nothing at launch and counts one only if its event had not completed when it was consumed.
    """

    def __init__(self) -> None:
        self.steps = 0
        self.lagged_steps = 0
        self.host_syncs = 0
        self.in_flight = 0
        self.in_flight_max = 0
        self.depth = 0
        self.drains: Counter = Counter()
        self.sync_reasons: Counter = Counter()
        self.off_reason = "pipeline feature off"
        #: open steps (exits read back later) and, of them, those the device planned from the one before
        self.open_steps = 0
        self.device_planned_steps = 0
        #: why runs of device-planned steps ended (the host planned the next step again)
        self.device_planning_ends: Counter = Counter()
        #: why decode steps with gate rows are not open ("" when they are)
        self.device_exit_off_reason = "--pipeline-device-exit off"

    def sync_step(self, syncs: int) -> None:
        self.steps += 1
        self.host_syncs += syncs

    def lagged_step(self) -> None:
        self.steps += 1
        self.lagged_steps += 1

    def open_step(self, device_planned: bool) -> None:
        self.steps += 1
        self.open_steps += 1
        self.device_planned_steps += int(device_planned)

    def launched(self, in_flight: int) -> None:
        self.in_flight = in_flight
        self.in_flight_max = max(self.in_flight_max, in_flight)

    def describe(self) -> dict:
        return {
            "enabled": not self.off_reason, "off_reason": self.off_reason, "depth": self.depth,
            "steps": self.steps, "lagged_steps": self.lagged_steps, "host_syncs": self.host_syncs,
            "host_syncs_per_step": round(self.host_syncs / self.steps, 3) if self.steps else 0.0,
            "in_flight": self.in_flight, "in_flight_max": self.in_flight_max,
            "synchronous_steps": dict(self.sync_reasons), "drains": dict(self.drains),
            "device_exit": {"enabled": not self.device_exit_off_reason, "off_reason": self.device_exit_off_reason,
                            "open_steps": self.open_steps, "device_planned_steps": self.device_planned_steps,
                            "ends": dict(self.device_planning_ends)},
        }


class _Values(NamedTuple):
    """What one ring entry held, copied out: the sampled tokens (and logprobs), and for an open
    step each row's exit, depth and position (else None)."""

    tokens: np.ndarray
    logprobs: np.ndarray | None
    top_ids: np.ndarray | None
    top_logprobs: np.ndarray | None
    exited: np.ndarray | None
    depth: np.ndarray | None
    position: np.ndarray | None


class _Entry:
    def __init__(self, rows: int, pin: bool) -> None:
        self.tokens = torch.empty(rows, dtype=torch.int64, pin_memory=pin)
        self.logprobs = torch.empty(rows, dtype=torch.float32, pin_memory=pin)
        #: an open step's exit mask and the depth / position each row ran at (the device planned them)
        self.exited = torch.empty(rows, dtype=torch.bool, pin_memory=pin)
        self.depth = torch.empty(rows, dtype=torch.int32, pin_memory=pin)
        self.position = torch.empty(rows, dtype=torch.int64, pin_memory=pin)
        self.top_ids: torch.Tensor | None = None
        self.top_logprobs: torch.Tensor | None = None
        self.count = 0
        self.has_logprobs = False
        self.has_rows = False
        self.event = None
        self.busy = False

    def take(self, stats: PipelineStats) -> _Values:
        """Wait for the copies (a host sync, counted, only if they have not completed), copy the
        values out and free the entry, whatever happens."""
        if self.event is not None and not self.event.query():
            stats.host_syncs += 1
            self.event.synchronize()
        try:
            m = self.count
            copy = (lambda t: t[:m].numpy().copy())
            rows = (copy(self.exited), copy(self.depth), copy(self.position)) if self.has_rows else (None,) * 3
            return _Values(copy(self.tokens), copy(self.logprobs) if self.has_logprobs else None,
                           None if self.top_ids is None else self.top_ids.numpy(),
                           None if self.top_logprobs is None else self.top_logprobs.numpy(), *rows)
        finally:
            self.busy = False


class PinnedRing:
    """``size`` entries of pinned host buffers for up to ``rows`` sampled tokens each."""

    def __init__(self, size: int, rows: int, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._entries = [_Entry(rows, self._cuda) for _ in range(size)]
        self._next = 0

    def resize(self, size: int) -> None:
        """At least ``size`` entries (the step loop sizes it to its in-flight bound)."""
        rows = self._entries[0].tokens.numel()
        while len(self._entries) < size:
            self._entries.append(_Entry(rows, self._cuda))

    def put(self, out, rows=None) -> _Entry:
        """Queue non-blocking copies of a :class:`SampleResult` into the next entry; ``rows``: an
        open step's ``(exited, depth, position)`` device tensors, copied too."""
        e = self._entries[self._next]
        if e.busy:
            raise RuntimeError(f"pinned readback ring overrun: all {len(self._entries)} entries hold unread steps")
        self._next = (self._next + 1) % len(self._entries)
        m = out.token_ids.shape[0]
        e.busy, e.count = True, m
        e.tokens[:m].copy_(out.token_ids, non_blocking=True)
        e.has_rows = rows is not None
        if e.has_rows:
            for dst, src in zip((e.exited, e.depth, e.position), rows):
                dst[:m].copy_(src, non_blocking=True)
        e.has_logprobs = out.logprobs is not None
        if e.has_logprobs:
            e.logprobs[:m].copy_(out.logprobs.float(), non_blocking=True)
        e.top_ids = None if out.top_ids is None else out.top_ids.to("cpu", non_blocking=True)
        e.top_logprobs = None if out.top_logprobs is None else out.top_logprobs.to("cpu", non_blocking=True)
        e.event = None
        if self._cuda:
            e.event = torch.cuda.Event()
            e.event.record()
        return e


class _RingHandle:
    """A launched step's claim on one ring entry: :meth:`_read` takes its values once (waiting only if the
    copies have not completed), freeing the entry."""

    def __init__(self, entry: _Entry | None, stats: PipelineStats) -> None:
        self._entry = entry
        self._stats = stats
        self._values: _Values | None = None

    def done(self) -> bool:
        e = self._entry
        return e is None or e.event is None or e.event.query()

    def _read(self) -> _Values:
        if self._values is None:
            entry, self._entry = self._entry, None
            self._values = entry.take(self._stats)
        return self._values


class LaggedStep(_RingHandle):
    """Handle of a step whose tokens are read back with a lag. ``shape`` (exits and token counts)
    is host-known at launch; :meth:`result` waits for the copies if they have not completed. No
    entry: the step sampled nothing (its result is its shape)."""

    def __init__(self, shape: StepResult, entry: _Entry | None, stats: PipelineStats) -> None:
        super().__init__(entry, stats)
        self.shape = shape

    def result(self) -> StepResult:
        if self._entry is None and self._values is None:
            return self.shape
        v = self._read()
        return StepResult(self.shape.exited, self.shape.num_tokens, v.tokens, v.logprobs, v.top_ids, v.top_logprobs)


class OpenStep(_RingHandle):
    """Handle of an *open* decode step: one whose exits the host does not know at launch (a row
    may exit on the gate) and that the device may have planned (rlt-decode's device-planned
    steps). Every row was sampled; the exit mask says whose token counts. :meth:`result_rows`
    gives the :class:`StepResult` of the rows ``index`` (batch order), which the host has
    planned by then as ``depth`` / ``position`` per row: the device's values must agree (a
    disagreement is an engine fault for the step, never a silent wrong token)."""

    #: the step loop keeps it in flight as the start (or next step) of a run of open steps
    opens_run = True

    def release(self) -> None:
        """Free the ring entry without using the values (the step's requests are gone, or it failed)."""
        self._read()

    def result_rows(self, index: np.ndarray, depth: np.ndarray, position: np.ndarray) -> StepResult:
        v = self._read()
        if not (np.array_equal(v.depth[index], depth) and np.array_equal(v.position[index], position)):
            raise RuntimeError(
                f"a device-planned decode step disagrees with the host's rows: device (depth, position) "
                f"{list(zip(v.depth[index].tolist(), v.position[index].tolist()))}, host "
                f"{list(zip(depth.tolist(), position.tolist()))}")
        ex = v.exited[index]
        take = index[ex]
        pick = (lambda a: None if a is None else a[take])
        return StepResult(ex, ex.astype(np.int64), v.tokens[take], pick(v.logprobs), pick(v.top_ids),
                          pick(v.top_logprobs))
