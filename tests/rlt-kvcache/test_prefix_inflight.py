"""Requests that share a prompt prefix a running request is still computing wait for its publication
instead of computing it again: a burst sharing a prefix computes it once, the hits are admitted in
the step after publication and get their first token ``loops`` steps later; output stays exact.

Steps and rows are counted with a step observer (the engine's public ``add_observer``)."""

from __future__ import annotations

import pytest

from kv_helpers import assert_matches_reference, kv_engine, metrics, prompts
from rlt.kvcache.options import PreemptionOptions
from rlt.platform import SamplingParams

OUT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SYSTEM_PAGES = 3  # block size 4


class Rows:
    """Per step: (request id, start, length, depth, in_prompt) of every row."""

    def __init__(self) -> None:
        self.steps: list[list[tuple]] = []

    def on_step(self, batch, result) -> None:
        self.steps.append([(r.request.request_id, r.start, r.length, r.depth, r.in_prompt) for r in batch.rows])

    def prompt_starts(self) -> dict[str, int]:
        """Where each request's prompt computation started (its first depth-0 prompt row)."""
        out: dict[str, int] = {}
        for rows in self.steps:
            for rid, start, _, depth, in_prompt in rows:
                if in_prompt and depth == 0:
                    out.setdefault(rid, start)
        return out

    def computed(self, rid: str, below: int) -> int:
        """Depth-0 prompt positions below ``below`` that ``rid`` computed."""
        return sum(max(0, min(start + n, below) - start) for rows in self.steps
                   for r, start, n, depth, p in rows if r == rid and p and depth == 0)

    def exit_step(self, rid: str, position: int, depth: int) -> int:
        """The step in which ``rid``'s prompt row covering ``position`` ran at ``depth``."""
        return next(i for i, rows in enumerate(self.steps) for r, start, n, d, p in rows
                    if r == rid and p and d == depth and start <= position < start + n)


def _drive(engine, items, abort_after: dict[str, int] | None = None):
    """Submit ``items`` [(id, prompt, params)] at once; returns (outputs, first-token step per id, rows)."""
    rows = Rows()
    engine.add_observer(rows)
    for rid, p, sp in items:
        engine.add_request(rid, p, sp)
    done, first, step = {}, {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.token_ids and o.request_id not in first:
                first[o.request_id] = step
            if o.finished:
                done[o.request_id] = o
        for rid, at in (abort_after or {}).items():
            if at == step:
                done[rid] = engine.abort_request(rid)
        engine.ctx.parts.kv_manager.audit()
        step += 1
    return done, first, rows


def _burst(path, n=6):
    system = prompts(1, seed=60, lo=4 * SYSTEM_PAGES, hi=4 * SYSTEM_PAGES)[0]
    tails = prompts(n, seed=61, lo=1, hi=3)
    return system, [(f"r{i}", system + t, OUT) for i, t in enumerate(tails)]


@pytest.mark.parametrize("preemption,chunk", [(None, None), (PreemptionOptions(), None), (None, 5),
                                              (PreemptionOptions(mode="recompute"), 5)])
def test_a_burst_sharing_a_prefix_computes_it_once_and_hits_follow_its_publication(tiny_checkpoint, preemption,
                                                                                   chunk):
    path = tiny_checkpoint(seed=5)
    system, items = _burst(path)
    engine = kv_engine(path, prefix_cache=True, preemption=preemption, chunk_limit=chunk)
    loops = engine.num_loops
    done, first, rows = _drive(engine, items)
    assert_matches_reference(path, [(p, sp) for _, p, sp in items], [done[rid] for rid, _, _ in items])
    shared = len(system)
    starts = rows.prompt_starts()
    assert starts["r0"] == 0 and all(starts[rid] == shared for rid, _, _ in items[1:])
    assert sum(rows.computed(rid, shared) for rid, _, _ in items) == shared  # computed once, by r0
    m = metrics(engine)
    assert m["prefix_cache_inflight_waits"] == len(items) - 1
    assert m["prefix_cache_hit_tokens"] == (len(items) - 1) * shared
    # r0's chunk holding the last shared position exits (publishes the page) at its last loop; the
    # hits are admitted in the next step and their first token comes `loops` steps after publication
    published = rows.exit_step("r0", shared - 1, loops - 1)
    assert first["r0"] >= published
    assert all(first[rid] == published + loops for rid, _, _ in items[1:]), (published, first)


def test_requests_not_sharing_the_prefix_are_admitted_past_a_waiting_one(tiny_checkpoint):
    path = tiny_checkpoint(seed=5)
    system, items = _burst(path, n=2)
    other = prompts(1, seed=62, lo=9, hi=9)[0]
    two = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, max_loops=2)
    items += [("x", other, OUT), ("two", items[0][1], two)]  # `two` runs 2 loops: other keys, never waits
    engine = kv_engine(path, prefix_cache=True)
    done, first, rows = _drive(engine, items)
    assert_matches_reference(path, [(p, sp) for _, p, sp in items], [done[rid] for rid, _, _ in items])
    step0 = {r[0] for r in rows.steps[0]}
    assert step0 == {"r0", "x", "two"}  # r1 waits for r0's pages; the others overtake it
    assert rows.prompt_starts()["r1"] == len(system) and metrics(engine)["prefix_cache_inflight_waits"] == 1


def test_a_waiter_whose_computing_request_is_aborted_computes_the_prefix_itself(tiny_checkpoint):
    path = tiny_checkpoint(seed=5)
    _, items = _burst(path, n=2)
    engine = kv_engine(path, prefix_cache=True)
    done, first, rows = _drive(engine, items, abort_after={"r0": 0})
    assert done["r0"].finish_reason == "abort"
    assert rows.prompt_starts()["r1"] == 0  # nothing was published: r1 computes every page
    assert_matches_reference(path, [(items[1][1], OUT)], [done["r1"]])
    assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_burst_sharing_a_prefix_under_preemption_is_exact(tiny_checkpoint, mode):
    path = tiny_checkpoint(seed=5)
    _, items = _burst(path, n=6)
    items += [(f"o{i}", p, OUT) for i, p in enumerate(prompts(3, seed=63, lo=10, hi=14))]
    engine = kv_engine(path, prefix_cache=True, preemption=PreemptionOptions(mode=mode, watermark=0.0),
                       num_kv_blocks=40, max_num_seqs=5)
    done, _, _ = _drive(engine, items)
    assert_matches_reference(path, [(p, sp) for _, p, sp in items], [done[rid] for rid, _, _ in items])
    m = metrics(engine)
    assert m["kv_preemptions"] > 0 and m["prefix_cache_inflight_waits"] > 0 and m["prefix_cache_hit_tokens"] > 0
    assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks
