"""KVCacheScheduler: the rlt-kvcache :class:`SchedulerPolicy`, a subclass of the base policy.

What it adds to the base :class:`rlt.platform.engine.scheduler.LoopScheduler` semantics (rows
refilled at loop granularity, transactional admission). Which prompt rows run in a step stays
the policy's ``prompt_chunker`` (:mod:`rlt.platform.engine.chunking`): the base one, or the one
rlt-prefill installs (chunked / wavefront prefill) — this policy only hands it runs (a prompt
from its cached prefix on, a recompute range) and grows KV for the chunks it starts:

- **Incremental KV** (``preemption`` on): before a step, every running request whose rows start
  a new position range (a depth-0 row: a decode row or a newly started chunk) grows its
  allocation to cover it, in scheduling order. When growth
  cannot be met, a victim is preempted: the worst running request by (priority, arrival) that is
  worse than the grower, sits at a chunk boundary (no row beyond depth 0: with wavefront prefill,
  no chunk in flight between loops) and is not already in the step being built. Without a victim
  the grower's depth-0 rows wait one step (keeping its pages; its deeper chunks still run). Admission charges what a
  request needs now plus this step's growth of the running set plus the watermark.
- **Preemption and recovery**: a victim is preempted only at depth 0, where no device state of
  its slot is live (its next input is an embedding), so it can resume in any slot with any
  executor. Its KV is either swapped (all planes, the version map included, to host memory and
  back into whatever blocks it gets) or dropped and recomputed on resume as a non-sampling run of
  full-depth prompt chunks over its generated positions (a victim still in its prompt simply
  restarts its prompt run from the cached prefix); recompute is exact only when
  every generated token ran the full depth, so only fixed-depth requests (τ >= 1, no prompt
  logprobs) are recomputed — adaptive-exit requests are always swapped. The sampler's per-slot
  step counter moves with the request, so seeded streams continue. A resumed request rejoins the
  queue under its original (priority, arrival) key.
- **Priority**: ``policy="priority"`` orders admission and victims by (priority, arrival); a
  waiting request may preempt a strictly lower-priority running one for a slot or for KV.
  ``policy="fcfs"`` orders by arrival only and never preempts to admit.
- **Prefix cache**: admission starts the prompt at its cached prefix; prompt pages are published
  when a prompt chunk covering them exits (the device has written every plane by then). A waiting
  request whose first uncached prompt page is being computed by a running request is not admitted
  (it would compute the same pages again): it waits for that page's publication and is admitted in
  the step after it, as a hit; requests behind it in the queue may be admitted meanwhile (it waits
  for a page, not for a resource). So a burst of requests sharing a prompt prefix computes the
  prefix once, and the hits then cost the step budget only their uncached tokens.

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
from rlt.platform.engine.chunking import PromptRun
from rlt.platform.engine.exit_policy import is_adaptive
from rlt.platform.engine.interfaces import FeatureMetric, Row, StepPlan, StepResult
from rlt.platform.engine.request import Request, RequestStatus
from rlt.platform.engine.scheduler import LoopScheduler


@attrs.define(eq=False)
class Preempted:
    #: where it stood (depth 0; its slot is stale): its decode row, or the rest of its prompt run
    #: as one ``in_prompt`` row (resumed through the chunker)
    row: Row
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


class KVCacheScheduler(LoopScheduler):
    supported_exit_latency = 0

    def __init__(self, *, kv: KVCacheManager, slots, swapper: HostSwapper | None, max_num_seqs: int,
                 max_num_batched_tokens: int, layout: KVLayout, preemption: PreemptionOptions | None,
                 executor=None, platform=None, chunk_limit: int | None = None) -> None:
        super().__init__(kv=kv, slots=slots, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         layout=layout, chunk_limit=chunk_limit)
        self.swapper = swapper
        self.options = preemption
        self.incremental = preemption is not None
        self.policy = preemption.policy if preemption is not None else "priority"
        #: callable -> the engine's executor (built after the scheduler), to drop a victim's slot state
        self._executor = executor
        self._platform = platform
        self._preempted: dict[Request, Preempted] = {}
        #: recompute in progress: the decode row to continue with once the recompute run completed
        self._resume_at: dict[Request, Row] = {}
        self._last_slot: dict[Request, int] = {}
        self._admitted_now: set[Request] = set()
        self._preempted_now: set[Request] = set()
        self.counters = PreemptionCounters()

    @classmethod
    def from_context(cls, ctx, preemption: PreemptionOptions | None) -> "KVCacheScheduler":
        p = ctx.parts
        return cls(kv=p.kv_manager, slots=p.slots, swapper=HostSwapper(ctx.cache), max_num_seqs=ctx.max_num_seqs,
                   max_num_batched_tokens=ctx.max_num_batched_tokens, layout=ctx.kv.layout, preemption=preemption,
                   executor=lambda: ctx.parts.executor, platform=ctx.platform)

    def key(self, req: Request) -> tuple[int, ...]:
        """Scheduling order: smaller first; the largest key is the first victim."""
        if self.policy == "fcfs":
            return (req.arrival_index,)
        return (req.params.priority, req.arrival_index)

    # -- admission -----------------------------------------------------------------------------------
    def _entry(self, req: Request, slot: int) -> tuple[Row, int, int]:
        """(entry, positions to allocate, cached pages) for admitting or resuming ``req``. The entry
        is a decode row, or an ``in_prompt`` row standing for a run ``[start, end)`` of chunks."""
        bs = self.kv.block_size
        saved = self._preempted.get(req)
        if saved is not None and saved.mode == "swap":
            row = attrs.evolve(saved.row, slot=slot)
            return row, max(saved.pages * bs, self._first_end(row)), 0
        target = saved.row.start if saved is not None else 0
        hit = self.kv.match_pages(req)
        if saved is not None:
            hit = min(hit, target // bs)
        start = hit * bs
        if saved is None or saved.row.in_prompt:  # a prompt run, from its cached prefix on
            row = Row(req, slot, start, req.num_prompt - start, 0, samples=True, in_prompt=True)
        elif start >= target:
            row = attrs.evolve(saved.row, slot=slot)
        else:  # recompute [start, target) without sampling, then decode on from target
            row = Row(req, slot, start, target - start, 0, samples=False, in_prompt=True)
        positions = self._first_end(row) if self.incremental else req.max_positions
        return row, positions, hit

    def _first_end(self, entry: Row) -> int:
        """One past the last position the entry's first step writes."""
        if not entry.in_prompt:
            return entry.end
        return entry.start + self.prompt_chunker.next_len(PromptRun(entry.slot, entry.end, entry.samples,
                                                                    entry.start))

    def _cost(self, entry: Row) -> int:
        if not entry.in_prompt:
            return entry.length
        return self.prompt_chunker.admission_cost(PromptRun(entry.slot, entry.end, entry.samples, entry.start))

    def _growth_reserve(self) -> int:
        if not self.incremental:
            return 0
        c = self.prompt_chunker
        need = 0
        for r in self._running:
            if c.active(r):
                need += self.kv.growth_blocks(r.slot, c.frontier(r))
            elif self._rows[r].depth == 0:
                need += self.kv.growth_blocks(r.slot, self._rows[r].end)
        if self._running:
            need += int(self.options.watermark * self.kv.num_blocks)
        return need

    def _admit_one(self, req: Request, slot: int, budget: int) -> tuple[Row | None, str]:
        """Take KV for ``req`` in ``slot``: (its entry, "") or (None, "budget" | "kv") when it does
        not fit (then nothing changed)."""
        row, positions, hit = self._entry(req, slot)
        if self._cost(row) > budget:
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
                if not saved.row.in_prompt:
                    self._resume_at[req] = saved.row
            # the sampler's step counter (seeded streams) and the token count travel with the request
            self.slots.num_generated[slot] = req.num_produced
        else:
            req.first_scheduled_time = time.monotonic()
        req.slot = slot
        req.status = RequestStatus.RUNNING
        if row.in_prompt:
            self.prompt_chunker.begin(req, slot, row.start, row.end, samples=row.samples)
        else:
            self._rows[req] = attrs.evolve(row, slot=slot)
        self._running.append(req)
        self._admitted_now.add(req)

    def _waits_for_prefix(self, req: Request) -> bool:
        """Whether ``req`` should wait for a prefix a running request is computing (swapped-out
        requests bring their own KV back and never wait)."""
        saved = self._preempted.get(req)
        return (saved is None or saved.mode != "swap") and self.kv.waits_for_inflight(req)

    def _admit(self) -> list[tuple[Request, BaseException]]:
        failed: list[tuple[Request, BaseException]] = []
        budget = self.step_budget_left()
        self.blocked_reason = None
        deferred: list[tuple[tuple[int, ...], Request]] = []  # waiting for an in-flight prefix
        try:
            self._admit_queue(failed, budget, deferred)
        finally:
            for item in deferred:
                heapq.heappush(self._waiting, item)
        if deferred and self.blocked_reason is None:
            self.blocked_reason = f"{len(deferred)} request(s) wait for a shared prompt prefix being computed"
        return failed

    def _admit_queue(self, failed: list, budget: int, deferred: list) -> None:
        while self._waiting:
            req = self._waiting[0][1]
            if req in self._preempted_now:
                self.blocked_reason = "a request preempted in this step waits for the next"
                break
            if self._waits_for_prefix(req):
                deferred.append(heapq.heappop(self._waiting))
                continue
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
            budget -= self._cost(row)

    # -- victims ---------------------------------------------------------------------------------------
    def _at_boundary(self, req: Request) -> bool:
        c = self.prompt_chunker
        return c.at_boundary(req) if c.active(req) else self._rows[req].depth == 0

    def _eligible(self, exclude: set[Request]) -> list[Request]:
        """Running requests that can be preempted now, worst first: at a boundary, and not held by a
        feature whose per-request state preemption cannot save (``Request.preemption_holds``)."""
        out = [r for r in self._running if r not in exclude and r not in self._admitted_now and self._at_boundary(r)
               and not r.preemption_holds]
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

    def _standing(self, req: Request) -> Row:
        """Where a request at a boundary continues: its decode row, or the rest of its run."""
        run = self.prompt_chunker.drop(req)
        if run is None:
            return self._rows.pop(req)
        start = run.resume_start
        return Row(req, run.slot, start, run.end - start, 0, samples=run.samples, in_prompt=True)

    def _preempt(self, victim: Request) -> None:
        row = self._standing(victim)
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
        """Grow every running request's KV to what its depth-0 rows write in this step; preempt or
        defer (those rows only) where it cannot."""
        rows: list[Row] = []
        in_step: set[Request] = set()
        for req in sorted(self._running, key=self.key):
            if req.status is not RequestStatus.RUNNING:  # preempted by a better request in this loop
                continue
            mine = self.rows_of(req)
            new = [r for r in mine if r.depth == 0]
            end = max((r.end for r in new), default=0)
            while new and not self.kv.grow(req.slot, req, end):
                victim = self._growth_victim(req, in_step)
                if victim is None:
                    break
                self._preempt(victim)
            else:
                rows.extend(mine)
                in_step.add(req)
                continue
            self.counters.stalls += 1
            deeper = [r for r in mine if r.depth > 0]  # chunks between loops keep running
            if deeper:
                rows.extend(deeper)
                in_step.add(req)
        order = {r: i for i, r in enumerate(self._running)}
        return sorted(rows, key=lambda row: order[row.request])  # stable: a request's chunks keep their order

    def schedule(self) -> StepPlan:
        self.kv.close_step()
        self._admitted_now.clear()
        self._preempted_now.clear()
        failed = self._admit()
        if self.incremental:
            self.start_due_chunks()
            rows = self._grow()
        else:
            rows = self.step_rows()
        self.kv.open_step(r.slot for r in rows)
        return StepPlan(tuple(rows), tuple(failed))

    def finish(self, request: Request) -> None:
        super().finish(request)
        self._preempted.pop(request, None)
        self._resume_at.pop(request, None)
        self._last_slot.pop(request, None)

    def advance(self, rows: Sequence[Row], result: StepResult, done: set[Request]) -> None:
        """Move each row on after a step; publish prompt pages whose every plane is written."""
        for row, exited, produced in zip(rows, result.exited, result.num_tokens):
            req = row.request
            if req in done or req.status is not RequestStatus.RUNNING:
                continue
            if exited and row.in_prompt:
                self.kv.publish(row.slot, row.end)  # every plane of positions [0, row.end) is written
            if self.advance_row(row, bool(exited), bool(produced)):  # a recompute run completed
                self._rows[req] = attrs.evolve(self._resume_at.pop(req), slot=row.slot)
        self.kv.close_step()

    # -- metrics ---------------------------------------------------------------------------------------
    def feature_metrics(self) -> list[FeatureMetric]:
        return scheduler_metrics(self.counters) if self.incremental else []
