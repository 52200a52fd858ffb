"""Randomized: thousands of admit / grow / preempt / resume / abort / finish operations on a small
pool, driven through the real scheduler policy and KV manager with a fake device.

The fake device writes, for every position a row runs at plane ``d``, a value that depends only
on the tokens up to that position and the plane (so cached prefix pages and recomputed pages hold
the same values as the original ones). Before every step, every position a row may read — below
its start, at every plane it was written — must read back its value through the row's current
block table: a page given to two owners, a page freed too early and reused, a wrong swap-in or a
wrong prefix hit all show up. After every operation the manager's audit checks refcounts, the
free list, limbo and the open step's blocks.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rlt.attention import KVCache, KVLayout
from rlt.kvcache.manager import KVCacheManager
from rlt.kvcache.options import PreemptionOptions
from rlt.kvcache.scheduler import KVCacheScheduler
from rlt.kvcache.swap import HostSwapper
from rlt.platform.engine.interfaces import StepResult
from rlt.platform.engine.request import Request, RequestStatus
from rlt.platform.engine.slots import SlotTable
from rlt.platform.sampling_params import SamplingParams

BS, PLANES, SEQS = 4, 3, 5


def _value(tokens, plane: int, planes: int) -> float:
    return float(hash((tuple(tokens), plane, planes)) % 100_003)


class FakeWorld:
    def __init__(self, rng: random.Random, num_blocks: int, mode: str, prefix: bool, layout=KVLayout.LAST_EXITED,
                 chunk_limit: int | None = None):
        self.rng = rng
        self.cache = KVCache.allocate(num_layers=1, num_blocks=num_blocks, block_size=BS, num_kv_heads=1, head_dim=1,
                                      num_planes=PLANES, layout=layout, dtype=torch.float32, device="cpu")
        self.kv = KVCacheManager(layout=layout, block_size=BS, num_blocks=num_blocks, num_planes=self.cache.num_planes,
                                 max_num_seqs=SEQS, max_pages=16, incremental=True, prefix_cache=prefix)
        self.slots = SlotTable(SEQS)
        self.sched = KVCacheScheduler(kv=self.kv, slots=self.slots, swapper=HostSwapper(self.cache), max_num_seqs=SEQS,
                                      max_num_batched_tokens=64, layout=layout,
                                      preemption=PreemptionOptions(mode=mode, recompute_max_tokens=20, watermark=0.0),
                                      chunk_limit=chunk_limit)
        self.layout = layout
        self.requests: list[Request] = []
        self.written: dict[tuple[int, int], int] = {}  # (arrival, position) -> planes written
        self.idle: dict[Request, int] = {}  # steps a running request was left out of the plan
        self.n = 0
        self.prompts = [[rng.randrange(3, 50) for _ in range(rng.randint(2, 14))] for _ in range(4)]

    def flat(self) -> torch.Tensor:
        return self.cache.k[0].view(-1)

    def add(self) -> None:
        rng = self.rng
        if rng.random() < 0.5:  # a shared prompt: prefix hits
            prompt = list(rng.choice(self.prompts))
        else:
            prompt = [rng.randrange(3, 50) for _ in range(rng.randint(1, 14))]
        adaptive = rng.random() < 0.3
        params = SamplingParams(max_tokens=rng.randint(1, 12), priority=rng.randint(0, 2))
        req = Request(f"q{self.n}", prompt, params, max_tokens=params.max_tokens, max_loops=rng.randint(1, PLANES),
                      min_loops=1, exit_threshold=0.5 if adaptive else 1.0, stop_token_ids=frozenset(),
                      arrival_index=self.n)
        self.n += 1
        self.sched.add(req)
        self.requests.append(req)
        self.idle[req] = 0

    def planes(self, req) -> int:
        return self.kv.planes_for(req.max_loops)

    def check_reads(self, rows) -> None:
        flat, tables = self.flat(), self.kv.block_tables
        for row in rows:
            req = row.request
            for pos in range(row.start):
                planes = self.written.get((req.arrival_index, pos), 0)
                if self.layout is KVLayout.SHARED:
                    planes = min(planes, 1)
                for plane in range(planes):
                    addr = int(tables[row.slot, plane, pos // BS]) * BS + pos % BS
                    want = _value(req.all_token_ids[:pos + 1], plane if self.layout is KVLayout.LAST_EXITED else 0,
                                  self.planes(req))
                    got = float(flat[addr])
                    assert got == want, f"{req.request_id} pos {pos} plane {plane}: read {got}, wrote {want}"

    def build(self, rows) -> list[tuple[int, float, tuple[int, int], int]]:
        """The step's writes (address, value, (request, position), planes), fixed when the batch is built."""
        tables, out = self.kv.block_tables, []
        for row in rows:
            req = row.request
            plane = row.depth if self.layout is KVLayout.LAST_EXITED else 0
            for pos in range(row.start, row.end):
                addr = int(tables[row.slot, plane, pos // BS]) * BS + pos % BS
                out.append((addr, _value(req.all_token_ids[:pos + 1], plane, self.planes(req)),
                            (req.arrival_index, pos), row.depth + 1))
        return out

    def write(self, writes) -> None:
        flat = self.flat()
        for addr, value, key, planes in writes:
            flat[addr] = value
            self.written[key] = max(self.written.get(key, 0), planes)

    def step(self, step: int) -> None:
        rng, sched, kv = self.rng, self.sched, self.kv
        plan = sched.schedule()
        assert not plan.failed
        kv.audit()
        rows = plan.rows
        self.check_reads(rows)
        writes = self.build(rows)
        if rows and rng.random() < 0.1:  # abort one request while the step is in flight
            victim = rng.choice(self.requests)
            if not victim.finished:
                sched.finish(victim)
                kv.audit()
        self.write(writes)  # the device runs the step (an aborted request's writes land in limbo blocks)
        exited = np.zeros(len(rows), bool)
        num = np.zeros(len(rows), np.int64)
        done = set()
        for i, row in enumerate(rows):
            req = row.request
            loop = row.depth + 1
            adaptive = not row.in_prompt and req.exit_threshold < 1.0
            exited[i] = loop >= req.max_loops or (adaptive and rng.random() < 0.4)
            if exited[i] and row.samples and not req.finished:
                num[i] = 1
                req.output_token_ids.append(rng.randrange(3, 50))
                req.exit_depths.append(loop)
                self.slots.num_generated[row.slot] = len(req.output_token_ids)
                if len(req.output_token_ids) >= req.max_tokens:
                    sched.finish(req)
                    done.add(req)
        sched.advance(rows, StepResult(exited, num, np.zeros(int(num.sum()), np.int64)), done)
        kv.audit()
        in_plan = {row.request for row in rows}
        for req in self.requests:  # a running (e.g. just restored) request is never left out for long
            self.idle[req] = 0 if req in in_plan or req.status is not RequestStatus.RUNNING else self.idle[req] + 1
            assert self.idle[req] < 40, f"running request {req.request_id} was not scheduled for 40 steps"


@pytest.mark.parametrize("mode,prefix,layout,chunk", [
    ("auto", True, KVLayout.LAST_EXITED, None), ("swap", False, KVLayout.LAST_EXITED, None),
    ("recompute", True, KVLayout.LAST_EXITED, None), ("auto", True, KVLayout.SHARED, None),
    ("auto", True, KVLayout.LAST_EXITED, 3),  # chunked prompts and recompute runs through the chunker
])
def test_random_operations_keep_every_invariant(mode, prefix, layout, chunk):
    rng = random.Random(f"{mode}-{prefix}-{layout.value}-{chunk}")
    w = FakeWorld(rng, num_blocks=36, mode=mode, prefix=prefix, layout=layout, chunk_limit=chunk)
    steps = 1500
    for step in range(steps):
        if step < steps - 300 and rng.random() < 0.35:
            w.add()
        w.step(step)
    for step in range(steps, steps + 2000):  # drain: everything finishes, nothing is lost
        if not (w.sched.num_running or w.sched.num_waiting):
            break
        w.step(step)
    assert all(r.finished for r in w.requests)
    assert w.kv.num_free == w.kv.num_blocks, "blocks leaked after every request finished"
    c = w.sched.counters
    assert c.preemptions > 20 and c.resumed > 20
    assert c.resumed_in_other_slot > 0
    if mode != "recompute":
        assert c.swaps > 0
    if mode != "swap":
        assert c.recomputes > 0
    if prefix:
        assert w.kv.hit_tokens > 0 and w.kv.index.evictions > 0
