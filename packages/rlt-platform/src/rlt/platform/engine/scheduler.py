"""The loop-level scheduler (Continuous Depth Batching).

Every step, every running request contributes one row: its current chunk at its current depth.
Rows of different requests and depths share the step's single call of the recurrent core; when a
row exits, its request moves to its next chunk (the next prompt piece, or the token just sampled)
and enters the following step at depth 0 — so requests are refilled at loop granularity, and new
requests are admitted between any two steps.

Admission is by (priority, arrival) and never overcommits: a request is admitted only when a slot
is free, the KV blocks for every position it can ever write are reserved, and its prompt chunk fits
the step's token budget. A request that could never fit is rejected up front by the engine.
"""

from __future__ import annotations

import heapq
import time

from rlt.attention import KVLayout
from rlt.platform.engine.request import Request, RequestStatus
from rlt.platform.engine.slots import SlotTable
from rlt.platform.kv import KVPool


class Scheduler:
    def __init__(self, pool: KVPool, table: SlotTable, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.pool = pool
        self.table = table
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[tuple[int, int, Request]] = []
        self.running: list[Request] = []
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        #: why the head of the queue is waiting, for stats and logs
        self.blocked_reason: str | None = None

    # -- queue ---------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        heapq.heappush(self.waiting, (req.params.priority, req.arrival_index, req))

    def remove_waiting(self, req: Request) -> bool:
        for i, (_, _, r) in enumerate(self.waiting):
            if r is req:
                self.waiting.pop(i)
                heapq.heapify(self.waiting)
                return True
        return False

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def first_chunk_len(self, num_prompt: int) -> int:
        """Full prefill runs the prompt as one chunk; SHARED runs it position by position."""
        return 1 if self.pool.layout is KVLayout.SHARED else num_prompt

    # -- steps ---------------------------------------------------------------------------------
    def _admit(self, seed_for) -> None:
        budget = self.max_num_batched_tokens - sum(r.chunk_len for r in self.running)
        self.blocked_reason = None
        while self.waiting:
            req = self.waiting[0][2]
            need = self.first_chunk_len(req.num_prompt)
            if not self._free_slots:
                self.blocked_reason = f"all {self.max_num_seqs} sequence slots are busy"
                return
            if need > budget:
                self.blocked_reason = f"step token budget ({self.max_num_batched_tokens}) is in use"
                return
            if not self.pool.can_fit_now(req.max_positions, req.max_loops):
                self.blocked_reason = (
                    f"waiting for KV blocks: needs {self.pool.blocks_needed(req.max_positions, req.max_loops)}, "
                    f"{self.pool.allocator.num_free} free"
                )
                return
            heapq.heappop(self.waiting)
            slot = self._free_slots.pop()
            self.pool.reserve(slot, req.max_positions, req.max_loops)
            req.slot = slot
            req.status = RequestStatus.RUNNING
            req.first_scheduled_time = time.monotonic()
            req.chunk_start, req.chunk_len, req.depth = 0, need, 0
            self.table.assign(slot, req, seed_for(req))
            self.running.append(req)
            budget -= need

    def schedule(self, seed_for) -> list[Request]:
        self._admit(seed_for)
        return list(self.running)

    def finish(self, req: Request) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.pool.release(req.slot)
            self._free_slots.append(req.slot)
        elif req.status is RequestStatus.WAITING:
            self.remove_waiting(req)
        req.status = RequestStatus.FINISHED

    def advance(self, req: Request, exited: bool, sampled: bool) -> None:
        """Move a row on after a step: one loop deeper, or to its next chunk."""
        if not exited:
            req.depth += 1
        elif sampled:
            req.chunk_start = req.num_prompt + len(req.output_token_ids) - 1
            req.chunk_len = 1
            req.depth = 0
        else:  # a prompt piece that does not end the prompt (SHARED): next position
            req.chunk_start += req.chunk_len
            req.chunk_len = min(self.first_chunk_len(req.num_prompt), req.num_prompt - req.chunk_start)
            req.depth = 0
        self.table.set_chunk(req.slot, req)
