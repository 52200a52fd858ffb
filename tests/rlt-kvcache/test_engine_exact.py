"""fp32 output is token-identical with and without incremental allocation, preemption (swap and
recompute, victims resumed in other slots) and prefix-cache hits — against the oracle for greedy
decoding, against the base engine for seeded sampling."""

from __future__ import annotations

import pytest

from kv_helpers import GREEDY, assert_matches_reference, base_engine, kv_engine, metrics, prompts, run
from rlt.kvcache.options import PreemptionOptions
from rlt.platform import SamplingParams

# 5 requests of up to 13 + 8 positions (6 pages x 4 planes = 24 blocks each) in a 32-block pool.
TINY_POOL = dict(num_kv_blocks=32, max_num_seqs=5)
SHORT = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_incremental_allocation_is_exact_and_holds_only_reached_pages(tiny_checkpoint):
    path = tiny_checkpoint(seed=1)
    items = [(p, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)) for p in prompts(3, seed=1)]
    held = {}

    def watch(engine, step):
        held.setdefault(step, engine.stats().num_free_kv_blocks)

    base = base_engine(path)
    run(base, items, watch)
    base_free = dict(held)
    held.clear()
    inc = kv_engine(path, preemption=PreemptionOptions())
    outs = run(inc, items, watch)
    assert_matches_reference(path, items, outs)
    assert metrics(inc)["kv_preemptions"] == 0
    # after the first step the incremental engine holds only the prompt pages, the base one every page
    assert held[0] > base_free[0]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_greedy_matches_oracle(tiny_checkpoint, mode):
    path = tiny_checkpoint(seed=1)
    items = [(p, SHORT) for p in prompts(5, seed=1)]
    engine = kv_engine(path, preemption=PreemptionOptions(mode=mode), **TINY_POOL)
    outs = run(engine, items)
    assert_matches_reference(path, items, outs)
    m = metrics(engine)
    assert m["kv_preemptions"] > 0 and m["kv_resumed"] == m["kv_preemptions"]
    assert m["kv_resumed_in_other_slot"] > 0  # a victim continued exactly in another request's old slot
    if mode == "swap":
        assert m["kv_preemptions_swap"] == m["kv_preemptions"] and m["kv_swapped_in_bytes"] == m["kv_swapped_out_bytes"] > 0
    else:
        assert m["kv_preemptions_recompute"] == m["kv_preemptions"] and m["kv_recompute_tokens"] > 0
    assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks


def test_preemption_seeded_sampling_matches_base_engine(tiny_checkpoint):
    path = tiny_checkpoint(seed=1)
    items = [(p, SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True))
             for i, p in enumerate(prompts(5, seed=2))]
    want = run(base_engine(path, max_num_seqs=5), items)
    engine = kv_engine(path, preemption=PreemptionOptions(mode="auto", recompute_max_tokens=8), num_kv_blocks=26,
                       max_num_seqs=5)
    got = run(engine, items)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    m = metrics(engine)  # auto chose both ways by size
    assert m["kv_preemptions_swap"] > 0 and m["kv_preemptions_recompute"] > 0


def test_adaptive_exit_requests_are_swapped_and_keep_their_exit_depths(tiny_checkpoint):
    path = tiny_checkpoint(seed=7, gate_bias=0.0)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=0.6)
    items = [(p, sp) for p in prompts(5, seed=8)]
    engine = kv_engine(path, preemption=PreemptionOptions(mode="recompute"), **TINY_POOL)
    outs = run(engine, items)
    assert_matches_reference(path, items, outs)
    assert len({d for o in outs for d in o.exit_depths}) > 1, "the gate should exit tokens at several depths"
    m = metrics(engine)
    assert m["kv_preemptions"] > 0 and m["kv_preemptions_recompute"] == 0  # recompute is never used for adaptive


def test_shared_layout_preemption_matches_its_oracle(tiny_checkpoint):
    path = tiny_checkpoint(seed=5)
    items = [(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)) for p in prompts(4, seed=5, lo=2, hi=7)]
    engine = kv_engine(path, preemption=PreemptionOptions(recompute_max_tokens=7), kv_layout="shared", num_kv_blocks=7,
                       max_num_seqs=4)
    outs = run(engine, items)
    assert_matches_reference(path, items, outs, layout="shared")
    m = metrics(engine)
    assert m["kv_preemptions_swap"] > 0 and m["kv_preemptions_recompute"] > 0


def test_chunked_prompts_with_preemption(tiny_checkpoint):
    path = tiny_checkpoint(seed=3)
    items = [(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)) for p in prompts(4, seed=3, lo=9, hi=13)]
    # prompt chunks of 5 (as rlt-prefill sets them): recompute runs in chunks too
    engine = kv_engine(path, preemption=PreemptionOptions(mode="recompute"), max_num_batched_tokens=16, chunk_limit=5,
                       **TINY_POOL)
    outs = run(engine, items)
    assert_matches_reference(path, items, outs)
    assert metrics(engine)["kv_recompute_tokens"] > 0


# -- prefix cache -----------------------------------------------------------------------------------
def test_prefix_full_and_partial_hits_are_exact(tiny_checkpoint):
    path = tiny_checkpoint(seed=4)
    system = prompts(1, seed=40, lo=12, hi=12)[0]
    a, b = prompts(2, seed=41, lo=3, hi=5)
    engine = kv_engine(path, prefix_cache=True)
    first = [(system + a, GREEDY)]
    outs = run(engine, first)
    assert metrics(engine)["prefix_cache_hit_tokens"] == 0
    assert metrics(engine)["prefix_cache_pages"] == len(system + a) // 4
    full = run(engine, first)  # the same prompt again: every full page but the last token's
    hit_full = metrics(engine)["prefix_cache_hit_tokens"]
    assert hit_full == (len(system + a) - 1) // 4 * 4
    partial = run(engine, [(system + b, GREEDY)])  # shares the system prompt's pages only
    assert metrics(engine)["prefix_cache_hit_tokens"] - hit_full == 12
    assert_matches_reference(path, first * 2 + [(system + b, GREEDY)], outs + full + partial)


def test_prefix_exactly_one_page_prompt_recomputes_its_last_token(tiny_checkpoint):
    path = tiny_checkpoint(seed=4)
    p = prompts(1, seed=42, lo=8, hi=8)[0]
    engine = kv_engine(path, prefix_cache=True)
    items = [(p, GREEDY)] * 2
    outs = run(engine, items[:1]) + run(engine, items[1:])
    assert metrics(engine)["prefix_cache_hit_tokens"] == 4  # page 2 holds the last prompt token
    assert_matches_reference(path, items, outs)


def test_prefix_is_not_shared_across_max_loops(tiny_checkpoint):
    path = tiny_checkpoint(seed=4)
    p = prompts(1, seed=43, lo=13, hi=13)[0]
    two = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, max_loops=2)
    four = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, max_loops=4)
    engine = kv_engine(path, prefix_cache=True)
    outs = run(engine, [(p, two)]) + run(engine, [(p, four)])
    assert metrics(engine)["prefix_cache_hit_tokens"] == 0  # a 2-loop prompt has no KV at depths 2-3
    outs += run(engine, [(p, two)]) + run(engine, [(p, four)])
    assert metrics(engine)["prefix_cache_hit_tokens"] == 2 * 12  # each hits its own entry
    assert metrics(engine)["prefix_cache_pages"] == 2 * 3
    assert_matches_reference(path, [(p, two), (p, four)] * 2, outs)


def test_prefix_cache_under_preemption_with_eviction(tiny_checkpoint):
    path = tiny_checkpoint(seed=1)
    system = prompts(1, seed=44, lo=8, hi=8)[0]
    items = [(system + q, SHORT) for q in prompts(4, seed=45, lo=1, hi=4)]
    items += [(p, SHORT) for p in prompts(2, seed=46)]
    engine = kv_engine(path, preemption=PreemptionOptions(), prefix_cache=True, **TINY_POOL)
    outs = run(engine, items)
    assert_matches_reference(path, items, outs)
    m = metrics(engine)
    assert m["prefix_cache_hit_tokens"] > 0 and m["kv_preemptions"] > 0
    assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks  # cached pages count as free


def test_prefix_cache_seeded_sampling_matches_base_engine(tiny_checkpoint):
    path = tiny_checkpoint(seed=1)
    system = prompts(1, seed=47, lo=10, hi=10)[0]
    items = [(system + q, SamplingParams(max_tokens=8, temperature=1.0, seed=7 + i, ignore_eos=True))
             for i, q in enumerate(prompts(4, seed=48, lo=1, hi=3))]
    want = run(base_engine(path), items[:1]) + run(base_engine(path), items[1:])
    engine = kv_engine(path, prefix_cache=True)
    got = run(engine, items[:1]) + run(engine, items[1:])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert metrics(engine)["prefix_cache_hit_tokens"] == 3 * 8


def test_prompt_logprobs_requests_bypass_the_prefix_cache(tiny_checkpoint):
    path = tiny_checkpoint(seed=4)
    p = prompts(1, seed=49, lo=12, hi=12)[0]
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    engine = kv_engine(path, prefix_cache=True)
    a = run(engine, [(p, sp)])[0]
    b = run(engine, [(p, sp)])[0]
    assert len(b.prompt_logprobs) == len(p) and b.prompt_logprobs == a.prompt_logprobs
