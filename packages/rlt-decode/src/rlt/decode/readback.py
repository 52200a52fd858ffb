"""Lagged readback of sampled tokens: a pinned ring of host buffers, the handle of a lagged step,
and the pipeline's counters.

A lagged decode step's sampled tokens (and logprobs) are copied device → host with non-blocking
copies into a :class:`PinnedRing` entry, behind an event recorded on the engine's stream; the
step's :class:`LaggedStep` handle knows its *shape* (which rows exited, how many tokens each
produced) on the host at launch, and its token values once the event has completed. An entry is
reused only after the step that filled it was consumed (its values copied out).

Owns: the ring's pinned buffers and events, :class:`PipelineStats`. Must not: wait on the device
anywhere but :meth:`LaggedStep.result` (which counts the wait when it really blocks).
"""

from __future__ import annotations

from collections import Counter

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

    def sync_step(self, syncs: int) -> None:
        self.steps += 1
        self.host_syncs += syncs

    def lagged_step(self) -> None:
        self.steps += 1
        self.lagged_steps += 1

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
        }


class _Entry:
    def __init__(self, rows: int, pin: bool) -> None:
        self.tokens = torch.empty(rows, dtype=torch.int64, pin_memory=pin)
        self.logprobs = torch.empty(rows, dtype=torch.float32, pin_memory=pin)
        self.top_ids: torch.Tensor | None = None
        self.top_logprobs: torch.Tensor | None = None
        self.count = 0
        self.has_logprobs = False
        self.event = None
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

    def put(self, out) -> _Entry:
        """Queue non-blocking copies of a :class:`SampleResult` into the next entry."""
        e = self._entries[self._next]
        if e.busy:
            raise RuntimeError(f"pinned readback ring overrun: all {len(self._entries)} entries hold unread steps")
        self._next = (self._next + 1) % len(self._entries)
        m = out.token_ids.shape[0]
        e.busy, e.count = True, m
        e.tokens[:m].copy_(out.token_ids, non_blocking=True)
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


class LaggedStep:
    """Handle of a step whose tokens are read back with a lag. ``shape`` (exits and token counts)
    is host-known at launch; :meth:`result` waits for the copies if they have not completed."""

    def __init__(self, shape: StepResult, entry: _Entry | None, stats: PipelineStats) -> None:
        self.shape = shape
        self._entry = entry
        self._stats = stats
        self._result: StepResult | None = None if entry is not None else shape

    def done(self) -> bool:
        e = self._entry
        return self._result is not None or e.event is None or e.event.query()

    def result(self) -> StepResult:
        if self._result is None:
            e = self._entry
            if e.event is not None and not e.event.query():
                self._stats.host_syncs += 1
                e.event.synchronize()
            try:
                m = e.count
                self._result = StepResult(
                    self.shape.exited, self.shape.num_tokens, e.tokens[:m].numpy().copy(),
                    e.logprobs[:m].numpy().copy() if e.has_logprobs else None,
                    None if e.top_ids is None else e.top_ids.numpy(),
                    None if e.top_logprobs is None else e.top_logprobs.numpy())
            finally:  # the entry is free again, whatever happened
                e.busy = False
                self._entry = None
        return self._result
