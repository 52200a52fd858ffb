"""The loop-level scheduler policy (Continuous Depth Batching): the base :class:`SchedulerPolicy`.

Every step, every running request contributes one row: its current chunk at its current depth.
Rows of different requests and depths share the step's single call of the recurrent core; when a
row exits, its request moves to its next chunk (the next prompt piece, or the token just sampled)
and enters the following step at depth 0 — so requests are refilled at loop granularity, and new
requests are admitted between any two steps.

Chunks: the prompt is a *run* handed to the policy's ``prompt_chunker``
(:class:`rlt.platform.engine.chunking.PromptChunker`), which decides which prompt rows run in
each step. The base chunker runs the prompt as one chunk (full prefill) unless ``chunk_limit``
caps its length (each chunk then runs all its loops before the next starts, so later chunks read
earlier chunks' KV at their own depth); SHARED runs the prompt position by position. A feature
replaces the chunker (``policy.prompt_chunker = ...`` from a scheduler wrapper: rlt-prefill's
chunked and wavefront prefill) without replacing the policy. Every generated token is a
one-position chunk, a decode row the policy keeps itself.

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
from rlt.platform.engine.chunking import PromptChunker, PromptRun
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
        #: which prompt rows run in each step (a feature may replace it; see the module docstring)
        self.prompt_chunker = PromptChunker(layout, chunk_limit, max_chunk=max_num_batched_tokens)
        self._waiting: list[tuple[tuple[int, ...], Request]] = []
        self._running: list[Request] = []
        #: the decode row of every running request that is not in a prompt run
        self._rows: dict[Request, Row] = {}
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        #: why the head of the queue is waiting, for stats and logs
        self.blocked_reason: str | None = None

    @property
    def chunk_limit(self) -> int | None:
        """The most prompt positions in one chunk (None: the whole prompt): the chunker's."""
        return self.prompt_chunker.chunk_limit

    @chunk_limit.setter
    def chunk_limit(self, value: int | None) -> None:
        self.prompt_chunker.chunk_limit = value

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

    def key(self, request: Request) -> tuple[int, ...]:
        """Scheduling order: smaller first (base: priority, then arrival)."""
        return (request.params.priority, request.arrival_index)

    def add(self, request: Request) -> None:
        heapq.heappush(self._waiting, (self.key(request), request))

    def first_chunk_len(self, num_prompt: int) -> int:
        """Length of a prompt's first chunk (what admission charges against the step budget)."""
        return self.prompt_chunker.chunk_len(num_prompt)

    # -- steps ---------------------------------------------------------------------------------
    def _decode_tokens(self) -> int:
        return sum(row.length for row in self._rows.values())

    def step_budget_left(self) -> int:
        """Tokens of the next step's budget that running requests leave for admissions: the budget
        minus the decode rows, the in-flight chunks and the chunks about to start."""
        c = self.prompt_chunker
        return self.max_num_batched_tokens - self._decode_tokens() - c.reserved() - c.wanted()

    def admission_cost(self, request: Request) -> int:
        """Tokens of the step budget ``request`` needs to be admitted (the chunker's)."""
        c = self.prompt_chunker
        return c.admission_cost(PromptRun(-1, request.num_prompt, True, 0))

    def _admit(self) -> list[tuple[Request, BaseException]]:
        failed: list[tuple[Request, BaseException]] = []
        budget = self.step_budget_left()
        self.blocked_reason = None
        while self._waiting:
            req = self._waiting[0][1]
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
            self.prompt_chunker.begin(req, slot, 0, req.num_prompt, samples=True)
            self._running.append(req)
            budget -= need
        return failed

    def start_due_chunks(self) -> None:
        """Start the prompt chunks due in the next step, within what decode rows and in-flight
        chunks leave of the budget."""
        c = self.prompt_chunker
        c.start_chunks(self._running, self.max_num_batched_tokens - self._decode_tokens() - c.reserved())

    def rows_of(self, request: Request) -> list[Row]:
        """The runnable rows of a running request in the next step."""
        c = self.prompt_chunker
        return c.rows(request) if c.active(request) else [self._rows[request]]

    def step_rows(self) -> list[Row]:
        """Start the chunks due now, then every running request's runnable rows (running order)."""
        self.start_due_chunks()
        return [row for req in self._running for row in self.rows_of(req)]

    def schedule(self) -> StepPlan:
        failed = self._admit()
        return StepPlan(tuple(self.step_rows()), tuple(failed))

    def finish(self, request: Request) -> None:
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
            self._rows.pop(request, None)
            self.prompt_chunker.drop(request)
            self.kv.free(request.slot)
            self._free_slots.append(request.slot)
        elif request.status is RequestStatus.WAITING:
            for i, (_, r) in enumerate(self._waiting):
                if r is request:
                    self._waiting.pop(i)
                    heapq.heapify(self._waiting)
                    break
        request.status = RequestStatus.FINISHED

    def decode_row(self, request: Request, slot: int) -> Row:
        """The row of the request's next generated position (its last sampled token's)."""
        pos = request.num_prompt + request.num_produced - 1
        return Row(request, slot, pos, 1, 0, samples=True, in_prompt=False)

    def advance_row(self, row: Row, exited: bool, produced: bool) -> bool:
        """Move one row on; True when the row completed its request's prompt run without sampling
        (a policy with non-sampling runs, rlt-kvcache's recompute, continues the request)."""
        req = row.request
        c = self.prompt_chunker
        if c.active(req) and row.in_prompt:
            if not c.advance(row, exited):
                return False
            if produced:
                self._rows[req] = self.decode_row(req, row.slot)
                return False
            return True
        if not exited:
            self._rows[req] = row.deeper()
        elif produced:
            self._rows[req] = self.decode_row(req, row.slot)
        return False

    def advance(self, rows: Sequence[Row], result: StepResult, done: set[Request]) -> None:
        """Move each row on after a step: one loop deeper, or to its request's next chunk."""
        for row, exited, produced in zip(rows, result.exited, result.num_tokens):
            req = row.request
            if req in done or req.status is not RequestStatus.RUNNING:
                continue
            self.advance_row(row, bool(exited), bool(produced))

    def victims(self, num_blocks: int) -> list[Request]:
        return []  # all-or-nothing admission never needs to preempt
