"""The loop-level scheduler policy (Continuous Depth Batching): the base :class:`SchedulerPolicy`.

Every step, every running request contributes one row: its current chunk at its current depth.
Rows of different requests and depths share the step's single call of the recurrent core; when a
row exits, its request moves to its next chunk (the next prompt piece, or the token just sampled)
and enters the following step at depth 0 — so requests are refilled at loop granularity, and new
requests are admitted between any two steps.

Chunks: the prompt runs as one chunk (full prefill) unless ``chunk_limit`` caps its length (a
feature such as rlt-prefill sets it; each chunk then runs all its loops before the next starts,
so later chunks read earlier chunks' KV at their own depth). SHARED runs the prompt position by
position. Every generated token is a one-position chunk.

Admission is by (priority, arrival) and never overcommits: a request is admitted only when a slot
is free, the KV manager allocates what it asks for, and its first chunk fits the step's token
budget. Admission is transactional: if anything fails after the slot or KV were taken, both are
given back and the request lands in the plan's ``failed`` list (the engine answers it with the
error). This module owns the rows; nothing else stores where a request is.
"""

from __future__ import annotations

import heapq
import time
from typing import Sequence

from rlt.attention import KVLayout
from rlt.platform.engine.interfaces import Row, StepPlan, StepResult
from rlt.platform.engine.request import Request, RequestStatus


class LoopScheduler:
    supported_exit_latency = 0
    #: serves ``SamplingParams.speculation`` (a speculating policy sets it; requests asking for
    #: speculation are refused at input processing otherwise)
    accepts_speculation = False

    def __init__(self, *, kv, slots, max_num_seqs: int, max_num_batched_tokens: int, layout: KVLayout,
                 chunk_limit: int | None = None) -> None:
        self.kv = kv
        self.slots = slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.layout = layout
        #: the most prompt positions in one chunk (None: the whole prompt)
        self.chunk_limit = chunk_limit
        self._waiting: list[tuple[int, int, Request]] = []
        self._running: list[Request] = []
        self._rows: dict[Request, Row] = {}
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        #: why the head of the queue is waiting, for stats and logs
        self.blocked_reason: str | None = None

    @classmethod
    def from_context(cls, ctx) -> "LoopScheduler":
        return cls(kv=ctx.parts.kv_manager, slots=ctx.parts.slots, max_num_seqs=ctx.max_num_seqs,
                   max_num_batched_tokens=ctx.max_num_batched_tokens, layout=ctx.kv.layout)

    # -- queue ---------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def running_requests(self) -> Sequence[Request]:
        return tuple(self._running)

    def add(self, request: Request) -> None:
        heapq.heappush(self._waiting, (request.params.priority, request.arrival_index, request))

    def first_chunk_len(self, num_prompt: int) -> int:
        """Length of a prompt's first chunk (what admission charges against the step budget)."""
        if self.layout is KVLayout.SHARED:
            return 1
        return num_prompt if self.chunk_limit is None else min(num_prompt, self.chunk_limit)

    def chunk_len(self, request: Request, start: int) -> int:
        """Length of the prompt chunk that starts at ``start``."""
        return self.first_chunk_len(request.num_prompt - start)

    def _prompt_row(self, request: Request, slot: int, start: int) -> Row:
        n = self.chunk_len(request, start)
        return Row(request, slot, start, n, 0, samples=start + n >= request.num_prompt, in_prompt=True)

    # -- steps ---------------------------------------------------------------------------------
    def step_budget_left(self) -> int:
        """Tokens of the next step's budget that running requests leave for admissions.

        Base: the budget minus the length of every running request's row. A policy whose rows
        are sized at schedule time (rlt-prefill) counts what it has reserved instead.
        """
        return self.max_num_batched_tokens - sum(self._rows[r].length for r in self._running)

    def admission_cost(self, request: Request) -> int:
        """Tokens of the step budget ``request`` needs to be admitted (base: its first chunk)."""
        return self.chunk_len(request, 0)

    def _admit(self) -> list[tuple[Request, BaseException]]:
        failed: list[tuple[Request, BaseException]] = []
        budget = self.step_budget_left()
        self.blocked_reason = None
        while self._waiting:
            req = self._waiting[0][2]
            need = self.admission_cost(req)
            if not self._free_slots:
                self.blocked_reason = f"all {self.max_num_seqs} sequence slots are busy"
                break
            if need > budget:
                self.blocked_reason = f"step token budget ({self.max_num_batched_tokens}) is in use"
                break
            slot = self._free_slots.pop()
            try:
                if not self.kv.allocate(slot, req):
                    self._free_slots.append(slot)
                    self.blocked_reason = (f"waiting for KV blocks: needs "
                                           f"{self.kv.blocks_for(req.max_positions, req.max_loops)}, "
                                           f"{self.kv.num_free} free")
                    break
                self.slots.assign(slot, req)
            except Exception as exc:  # noqa: BLE001 - whatever failed, the request gets it as its error
                self.kv.free(slot)  # whatever was taken for it (freeing an empty slot is a no-op)
                self._free_slots.append(slot)
                heapq.heappop(self._waiting)
                req.status = RequestStatus.FINISHED
                failed.append((req, exc))
                continue
            heapq.heappop(self._waiting)
            req.slot = slot
            req.status = RequestStatus.RUNNING
            req.first_scheduled_time = time.monotonic()
            self._rows[req] = self._prompt_row(req, slot, 0)
            self._running.append(req)
            budget -= need
        return failed

    def schedule(self) -> StepPlan:
        failed = self._admit()
        return StepPlan(tuple(self._rows[r] for r in self._running), tuple(failed))

    def finish(self, request: Request) -> None:
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
            self._rows.pop(request, None)
            self.kv.free(request.slot)
            self._free_slots.append(request.slot)
        elif request.status is RequestStatus.WAITING:
            for i, (_, _, r) in enumerate(self._waiting):
                if r is request:
                    self._waiting.pop(i)
                    heapq.heapify(self._waiting)
                    break
        request.status = RequestStatus.FINISHED

    def advance(self, rows: Sequence[Row], result: StepResult, done: set[Request]) -> None:
        """Move each row on after a step: one loop deeper, or to its request's next chunk."""
        for row, exited, produced in zip(rows, result.exited, result.num_tokens):
            req = row.request
            if req in done or req.status is not RequestStatus.RUNNING:
                continue
            if not exited:
                nxt = row.deeper()
            elif produced:
                pos = req.num_prompt + req.num_produced - 1
                nxt = Row(req, row.slot, pos, 1, 0, samples=True, in_prompt=False)
            else:  # a prompt chunk that does not end the prompt: the next one
                nxt = self._prompt_row(req, row.slot, row.end)
            self._rows[req] = nxt

    def victims(self, num_blocks: int) -> list[Request]:
        return []  # all-or-nothing admission never needs to preempt
