"""KVCacheScheduler: the rlt-kvcache :class:`SchedulerPolicy` (loop-level, like the base policy).

What it adds to the base :class:`rlt.platform.engine.scheduler.LoopScheduler` semantics (one row
per running request per step, refilled at loop granularity, transactional admission):

- **Incremental KV** (``preemption`` on): before a step, every running row that starts a new
  position range (depth 0) grows its allocation to cover it, in scheduling order. When growth
  cannot be met, a victim is preempted: the worst running request by (priority, arrival) that is
  worse than the grower, sits at a chunk boundary (depth 0) and is not already in the step being
  built. Without a victim the grower waits one step (keeping its pages). Admission charges what a
  request needs now plus this step's growth of the running set plus the watermark.
- **Preemption and recovery**: a victim is preempted only at depth 0, where no device state of
  its slot is live (its next input is an embedding), so it can resume in any slot with any
  executor. Its KV is either swapped (all planes, the version map included, to host memory and
  back into whatever blocks it gets) or dropped and recomputed on resume as non-sampling
  full-depth prompt chunks over its prompt and generated positions; recompute is exact only when
  every generated token ran the full depth, so only fixed-depth requests (τ >= 1, no prompt
  logprobs) are recomputed — adaptive-exit requests are always swapped. The sampler's per-slot
  step counter moves with the request, so seeded streams continue. A resumed request rejoins the
  queue under its original (priority, arrival) key.
- **Priority**: ``policy="priority"`` orders admission and victims by (priority, arrival); a
  waiting request may preempt a strictly lower-priority running one for a slot or for KV.
  ``policy="fcfs"`` orders by arrival only and never preempts to admit.
- **Prefix cache**: admission starts the prompt at its cached prefix; prompt pages are published
  when a prompt chunk covering them exits (the device has written every plane by then).

Must not: touch device storage except through the swapper, or hold device state.
"""

from __future__ import annotations

import heapq
import time
from typing import Sequence

import attrs

from rlt.attention import KVLayout
from rlt.kvcache.manager import KVCacheManager
from rlt.kvcache.metrics import scheduler_metrics
from rlt.kvcache.options import PreemptionOptions
from rlt.kvcache.swap import HostSwapper, SwappedKV
from rlt.platform.engine.exit_policy import is_adaptive
from rlt.platform.engine.interfaces import FeatureMetric, Row, StepPlan, StepResult
from rlt.platform.engine.request import Request, RequestStatus
from rlt.platform.engine.scheduler import LoopScheduler


@attrs.define(eq=False)
class Preempted:
    row: Row  # where it stood (depth 0); its slot is stale
    mode: str  # "swap" | "recompute"
    kv: SwappedKV | None = None
    pages: int = 0


@attrs.define
class PreemptionCounters:
    preemptions: int = 0
    swaps: int = 0
    recomputes: int = 0
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    recompute_tokens: int = 0
    resumed: int = 0
    resumed_in_other_slot: int = 0
    priority_preemptions: int = 0
    stalls: int = 0


class KVCacheScheduler:
    supported_exit_latency = 0

    def __init__(self, *, kv: KVCacheManager, slots, swapper: HostSwapper | None, max_num_seqs: int,
                 max_num_batched_tokens: int, layout: KVLayout, preemption: PreemptionOptions | None,
                 executor=None, platform=None, chunk_limit: int | None = None) -> None:
        self.kv = kv
        self.slots = slots
        self.swapper = swapper
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.layout = layout
        self.options = preemption
        self.incremental = preemption is not None
        self.policy = preemption.policy if preemption is not None else "priority"
        #: the most prompt positions in one chunk (None: the whole prompt); rlt-prefill may set it
        self.chunk_limit = chunk_limit
        #: callable -> the engine's executor (built after the scheduler), to drop a victim's slot state
        self._executor = executor
        self._platform = platform
        self._waiting: list[tuple[tuple[int, ...], Request]] = []
        self._running: list[Request] = []
        self._rows: dict[Request, Row] = {}
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._preempted: dict[Request, Preempted] = {}
        #: recompute in progress: the row to continue with once positions [0, row.start) have KV again
        self._resume_at: dict[Request, Row] = {}
        self._last_slot: dict[Request, int] = {}
        self._admitted_now: set[Request] = set()
        self._preempted_now: set[Request] = set()
        self.counters = PreemptionCounters()
        self.blocked_reason: str | None = None

    @classmethod
    def from_context(cls, ctx, preemption: PreemptionOptions | None) -> "KVCacheScheduler":
        p = ctx.parts
        return cls(kv=p.kv_manager, slots=p.slots, swapper=HostSwapper(ctx.cache), max_num_seqs=ctx.max_num_seqs,
                   max_num_batched_tokens=ctx.max_num_batched_tokens, layout=ctx.kv.layout, preemption=preemption,
                   executor=lambda: ctx.parts.executor, platform=ctx.platform)

    # -- queue -------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def running_requests(self) -> Sequence[Request]:
        return tuple(self._running)

    def key(self, req: Request) -> tuple[int, ...]:
        """Scheduling order: smaller first; the largest key is the first victim."""
        if self.policy == "fcfs":
            return (req.arrival_index,)
        return (req.params.priority, req.arrival_index)

    def add(self, request: Request) -> None:
        heapq.heappush(self._waiting, (self.key(request), request))

    # Prompt chunking is the base policy's (public methods over ``layout`` and ``chunk_limit``).
    first_chunk_len = LoopScheduler.first_chunk_len
    chunk_len = LoopScheduler.chunk_len

    def _prompt_row(self, req: Request, slot: int, start: int) -> Row:
        n = self.chunk_len(req, start)
        return Row(req, slot, start, n, 0, samples=start + n >= req.num_prompt, in_prompt=True)

    def _recompute_row(self, req: Request, slot: int, start: int, target: int) -> Row:
        n = min(self.first_chunk_len(target - start), self.max_num_batched_tokens)
        return Row(req, slot, start, n, 0, samples=False, in_prompt=True)

    # -- admission -----------------------------------------------------------------------------------
    def _entry(self, req: Request, slot: int) -> tuple[Row, int, int]:
        """(first row, positions to allocate, cached pages) for admitting or resuming ``req``."""
        bs = self.kv.block_size
        saved = self._preempted.get(req)
        if saved is not None and saved.mode == "swap":
            row = attrs.evolve(saved.row, slot=slot)
            return row, max(saved.pages * bs, row.end), 0
        target = saved.row.start if saved is not None else 0
        hit = self.kv.match_pages(req)
        if saved is not None:
            hit = min(hit, target // bs)
        start = hit * bs
        if saved is None:
            row = self._prompt_row(req, slot, start)
        elif start >= target:
            row = attrs.evolve(saved.row, slot=slot)
        else:
            row = self._recompute_row(req, slot, start, target)
        positions = row.end if self.incremental else req.max_positions
        return row, positions, hit

    def _growth_reserve(self) -> int:
        if not self.incremental:
            return 0
        need = sum(self.kv.growth_blocks(r.slot, self._rows[r].end) for r in self._running
                   if self._rows[r].depth == 0)
        if self._running:
            need += int(self.options.watermark * self.kv.num_blocks)
        return need

    def _admit_one(self, req: Request, slot: int, budget: int) -> tuple[Row | None, str]:
        """Take KV for ``req`` in ``slot``: (its first row, "") or (None, "budget" | "kv") when it does
        not fit (then nothing changed)."""
        row, positions, hit = self._entry(req, slot)
        if row.length > budget:
            self.blocked_reason = f"step token budget ({self.max_num_batched_tokens}) is in use"
            return None, "budget"
        saved = self._preempted.get(req)
        swap = saved is not None and saved.mode == "swap"
        if not self.kv.admit(slot, req, positions, cached_pages=hit, reserve=self._growth_reserve(),
                             use_cache=not swap):
            self.blocked_reason = (f"waiting for KV blocks: needs {self.kv.blocks_for(positions, req.max_loops)}, "
                                   f"{self.kv.num_free} free")
            return None, "kv"
        try:
            self.slots.assign(slot, req)
            if swap:
                self.swapper.restore(self.kv.table(slot), saved.kv)
        except BaseException:
            self.kv.free(slot)
            raise
        return row, ""

    def _start(self, req: Request, slot: int, row: Row) -> None:
        saved = self._preempted.pop(req, None)
        if saved is not None:
            c = self.counters
            c.resumed += 1
            c.resumed_in_other_slot += slot != self._last_slot.get(req)
            if saved.mode == "swap":
                c.swapped_in_bytes += saved.kv.nbytes
            elif row.start < saved.row.start:
                c.recompute_tokens += saved.row.start - row.start
                self._resume_at[req] = saved.row
            # the sampler's step counter (seeded streams) and the token count travel with the request
            self.slots.num_generated[slot] = len(req.output_token_ids)
        else:
            req.first_scheduled_time = time.monotonic()
        req.slot = slot
        req.status = RequestStatus.RUNNING
        self._rows[req] = attrs.evolve(row, slot=slot)
        self._running.append(req)
        self._admitted_now.add(req)

    def _admit(self) -> list[tuple[Request, BaseException]]:
        failed: list[tuple[Request, BaseException]] = []
        budget = self.max_num_batched_tokens - sum(self._rows[r].length for r in self._running)
        self.blocked_reason = None
        while self._waiting:
            req = self._waiting[0][1]
            if req in self._preempted_now:
                self.blocked_reason = "a request preempted in this step waits for the next"
                break
            if not self._free_slots:
                victim = self._admission_victim(req)
                if victim is None:
                    self.blocked_reason = f"all {self.max_num_seqs} sequence slots are busy"
                    break
                self.counters.priority_preemptions += 1
                self._preempt(victim)
                continue
            slot = self._free_slots.pop()
            try:
                row, why = self._admit_one(req, slot, budget)
            except Exception as exc:  # noqa: BLE001 - whatever failed, the request gets it as its error
                self._free_slots.append(slot)
                heapq.heappop(self._waiting)
                self._preempted.pop(req, None)
                req.status = RequestStatus.FINISHED
                failed.append((req, exc))
                continue
            if row is None:
                self._free_slots.append(slot)
                victim = self._admission_victim(req) if why == "kv" else None
                if victim is None:
                    break
                self.counters.priority_preemptions += 1
                self._preempt(victim)
                continue
            heapq.heappop(self._waiting)
            self._start(req, slot, row)
            budget -= row.length
        return failed

    # -- victims ---------------------------------------------------------------------------------------
    def _eligible(self, exclude: set[Request]) -> list[Request]:
        """Running requests that can be preempted now, worst first."""
        out = [r for r in self._running if self._rows[r].depth == 0 and r not in exclude
               and r not in self._admitted_now]
        return sorted(out, key=self.key, reverse=True)

    def _admission_victim(self, req: Request) -> Request | None:
        if self.policy != "priority" or not self.incremental:
            return None
        for v in self._eligible(set()):
            return v if v.params.priority > req.params.priority else None
        return None

    def _growth_victim(self, req: Request, in_step: set[Request]) -> Request | None:
        for v in self._eligible(in_step | {req}):
            return v if self.key(v) > self.key(req) else None
        return None

    def victims(self, num_blocks: int) -> list[Request]:
        """The requests preemption would take, worst first, to free ``num_blocks`` blocks."""
        if not self.incremental:
            return []
        out, freed = [], 0
        for v in self._eligible(set()):
            if freed >= num_blocks:
                break
            out.append(v)
            freed += self.kv.held_blocks(v.slot)
        return out if freed >= num_blocks else []

    def _mode(self, req: Request, row: Row) -> str:
        mode = self.options.mode
        exact_recompute = not is_adaptive(req.exit_threshold) and req.params.prompt_logprobs is None
        if mode == "swap" or not exact_recompute:
            return "swap"
        if mode == "recompute":
            return "recompute"
        return "recompute" if row.start <= self.options.recompute_max_tokens else "swap"

    def _preempt(self, victim: Request) -> None:
        row = self._rows.pop(victim)
        self._running.remove(victim)
        slot = victim.slot
        target = self._resume_at.pop(victim, None)
        if target is not None:  # preempted again while recomputing: keep recomputing towards the same row
            row, mode = target, "recompute"
        else:
            mode = self._mode(victim, row)
        saved = Preempted(row, mode, pages=self.kv.num_pages(slot))
        c = self.counters
        c.preemptions += 1
        if mode == "swap":
            saved.kv = self.swapper.save(self.kv.table(slot))
            c.swaps += 1
            c.swapped_out_bytes += saved.kv.nbytes
        else:
            c.recomputes += 1
        if self._platform is not None and self._platform.sync_before_reuse:
            self._platform.synchronize()
        self.kv.free(slot)
        if self._executor is not None:
            self._executor().release(slot)
        self._free_slots.append(slot)
        self._last_slot[victim] = slot
        victim.status = RequestStatus.WAITING
        victim.slot = -1
        self._preempted[victim] = saved
        self._preempted_now.add(victim)
        heapq.heappush(self._waiting, (self.key(victim), victim))

    # -- steps ---------------------------------------------------------------------------------------
    def _grow(self) -> list[Row]:
        """Grow every running row's KV to what this step writes; preempt or defer where it cannot."""
        rows: list[Row] = []
        in_step: set[Request] = set()
        for req in sorted(self._running, key=self.key):
            if req not in self._rows:  # preempted by a better request in this loop
                continue
            row = self._rows[req]
            while row.depth == 0 and not self.kv.grow(req.slot, req, row.end):
                victim = self._growth_victim(req, in_step)
                if victim is None:
                    break
                self._preempt(victim)
            else:
                rows.append(row)
                in_step.add(req)
                continue
            self.counters.stalls += 1
        by_req = {r.request: r for r in rows}
        return [by_req[r] for r in self._running if r in by_req]

    def schedule(self) -> StepPlan:
        self.kv.close_step()
        self._admitted_now.clear()
        self._preempted_now.clear()
        failed = self._admit()
        rows = self._grow() if self.incremental else [self._rows[r] for r in self._running]
        self.kv.open_step(r.slot for r in rows)
        return StepPlan(tuple(rows), tuple(failed))

    def finish(self, request: Request) -> None:
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
            self._rows.pop(request, None)
            self.kv.free(request.slot)
            self._free_slots.append(request.slot)
        elif request.status is RequestStatus.WAITING:
            for i, (_, r) in enumerate(self._waiting):
                if r is request:
                    self._waiting.pop(i)
                    heapq.heapify(self._waiting)
                    break
        self._preempted.pop(request, None)
        self._resume_at.pop(request, None)
        self._last_slot.pop(request, None)
        request.status = RequestStatus.FINISHED

    def advance(self, rows: Sequence[Row], result: StepResult, done: set[Request]) -> None:
        """Move each row on after a step: one loop deeper, or to its request's next chunk."""
        for row, exited, produced in zip(rows, result.exited, result.num_tokens):
            req = row.request
            if req in done or req.status is not RequestStatus.RUNNING:
                continue
            if exited and row.in_prompt:
                self.kv.publish(row.slot, row.end)  # every plane of these positions is written
            if not exited:
                nxt = row.deeper()
            elif produced:
                pos = req.num_prompt + req.num_produced - 1
                nxt = Row(req, row.slot, pos, 1, 0, samples=True, in_prompt=False)
            elif req in self._resume_at:
                target = self._resume_at[req]
                if row.end >= target.start:
                    nxt = attrs.evolve(self._resume_at.pop(req), slot=row.slot)
                else:
                    nxt = self._recompute_row(req, row.slot, row.end, target.start)
            else:  # a prompt chunk that does not end the prompt: the next one
                nxt = self._prompt_row(req, row.slot, row.end)
            self._rows[req] = nxt
        self.kv.close_step()

    # -- metrics ---------------------------------------------------------------------------------------
    def feature_metrics(self) -> list[FeatureMetric]:
        return scheduler_metrics(self.counters) if self.incremental else []
