"""Decode smoothness: the cap on the prompt rows of a step that carries decode rows
(:class:`rlt.prefill.scheduler.StepCost`). What a step is made of, not how long it takes: the
cost model is checked directly, and engines are checked to build steps that respect it, to shorten
late (attention-heavy) chunks, to leave a lone prompt uncapped, and to stay oracle-exact."""

from __future__ import annotations

import math

import pytest

from prefill_helpers import GREEDY, RowLog, chunked_engine, oracle, prompts
from rlt.platform import SamplingParams
from rlt.prefill.scheduler import StepCost, attention_tokens_for

COST = StepCost(ratio=2.0, overhead_tokens=40, attention_tokens=64)  # cap with 3 decoders: 43
SMOOTH = dict(decode_step_ratio=2.0, step_overhead_tokens=40, attention_tokens=64)
DECODE = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


def test_row_cost_counts_linear_work_and_mean_causal_context():
    c = StepCost(ratio=2.0, overhead_tokens=10, attention_tokens=100)
    assert c.row(0, 1) == pytest.approx(1 * (1 + 1 / 100))  # one position attends to itself
    assert c.row(0, 4) == pytest.approx(4 + (1 + 2 + 3 + 4) / 100)  # keys 1..4
    assert c.row(50, 10) == pytest.approx(10 + sum(range(51, 61)) / 100)
    assert attention_tokens_for(2048) == 12288  # Ouro-1.4B: 6 x hidden


def test_cap_is_ratio_minus_one_times_overhead_plus_decode_tokens_and_off_without_decodes():
    c = StepCost(ratio=1.5, overhead_tokens=2048, attention_tokens=12288)
    assert c.cap(32) == pytest.approx(0.5 * 2080)
    assert c.cap(0) == math.inf  # nothing to protect: only the token budget
    assert StepCost(ratio=0, overhead_tokens=2048, attention_tokens=12288).cap(32) == math.inf


@pytest.mark.parametrize("start", [0, 3, 100, 5000])
@pytest.mark.parametrize("cost", [0.0, 0.9, 1.0, 7.3, 43.0, 100.0, 5000.0])
@pytest.mark.parametrize("limit", [0, 1, 17, 4096])
def test_fit_is_the_longest_row_within_the_cost(start, cost, limit):
    n = COST.fit(start, cost, limit)
    brute = max((m for m in range(limit + 1) if m == 0 or COST.row(start, m) <= cost), default=0)
    assert n == brute
    assert COST.fit(start, math.inf, limit) == limit


def _prompt_cost(step, ids, prompt_len=300):
    return sum(COST.row(s, n) for rid, s, n, _ in step if rid in ids and s < prompt_len)


def _decoders_then_long(path, *, wavefront=False, chunk_size=0, budget=64, long_len=300):
    log = RowLog()
    engine = chunked_engine(path, budget=budget, chunk_size=chunk_size, wavefront=wavefront, smoothness=SMOOTH)
    engine.add_observer(log)
    dec = prompts((5, 6, 7), seed=4)
    for i, p in enumerate(dec):
        engine.add_request(f"d{i}", p, DECODE)
    while len(log.steps) < 6:  # the decoders are past their prompts
        engine.step()
    long = prompts((long_len,), seed=9)[0]
    engine.add_request("long", long, GREEDY)
    outs = {}
    while "long" not in outs:
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    for rid in ("d0", "d1", "d2"):
        engine.abort_request(rid)
    return log, long, outs["long"]


@pytest.mark.parametrize("wavefront,chunk_size", [(False, 0), (True, 8)], ids=["sequential", "wavefront"])
def test_steps_with_decode_rows_keep_prompt_cost_under_the_cap(tiny_checkpoint, wavefront, chunk_size):
    path = tiny_checkpoint(seed=21, max_position_embeddings=1024)
    log, long, out = _decoders_then_long(path, wavefront=wavefront, chunk_size=chunk_size)
    assert list(out.token_ids) == oracle(path, [long], GREEDY)[0][0]
    mixed = [st for st in log.steps if any(rid == "long" and s < len(long) for rid, s, *_ in st)]
    assert mixed and all({"d0", "d1", "d2"} <= {rid for rid, *_ in st} for st in mixed)
    cap = COST.cap(3)
    assert cap == pytest.approx(43.0)
    assert all(_prompt_cost(st, {"long"}) <= cap + 1e-9 for st in mixed)
    # the cap, not the token budget (64 - 3 decode tokens), sized the chunks
    chunks = sorted({(s, n) for st in mixed for rid, s, n, _ in st if rid == "long" and s < len(long)})
    assert max(n for _, n in chunks) < 61
    starts = chunks
    if not wavefront:  # late chunks attend to more context: the cap makes them shorter
        assert starts[0][1] == COST.fit(0, cap, 61) == 33
        assert starts[-2][1] < starts[0][1] // 2, starts
        assert sum(n for _, n in starts) == len(long)
    else:  # several 8-position chunks in flight at once, at different depths, all within the cap
        per_step = [[(s, d) for rid, s, n, d in st if rid == "long" and s < len(long)] for st in mixed]
        assert max(len(x) for x in per_step) >= 3
        assert any(len({d for _, d in x}) >= 3 for x in per_step)


def test_a_lone_prompt_is_not_capped(tiny_checkpoint):
    """No decode rows in the step: only the token budget sizes the chunks."""
    path = tiny_checkpoint(seed=21, max_position_embeddings=1024)
    log = RowLog()
    engine = chunked_engine(path, budget=64, smoothness=SMOOTH)
    engine.add_observer(log)
    p = prompts((300,), seed=9)[0]
    engine.add_request("long", p, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    lens = [n for st in log.steps for rid, s, n, _ in st if n > 1]
    assert lens[0] == 64 and max(_prompt_cost(st, {"long"}) for st in log.steps) > COST.cap(3)


def test_ratio_zero_turns_the_cap_off(tiny_checkpoint):
    path = tiny_checkpoint(seed=21, max_position_embeddings=1024)
    log = RowLog()
    engine = chunked_engine(path, budget=64, smoothness=dict(SMOOTH, decode_step_ratio=0))
    engine.add_observer(log)
    for i, p in enumerate(prompts((5, 6, 7), seed=4)):
        engine.add_request(f"d{i}", p, DECODE)
    for _ in range(6):
        engine.step()
    engine.add_request("long", prompts((300,), seed=9)[0], GREEDY)
    for _ in range(8):
        engine.step()
    lens = [n for st in log.steps[6:] for rid, s, n, _ in st if rid == "long"]
    assert lens[0] == 61  # the budget less the 3 decode tokens, as before the cap existed


def test_a_prompt_always_progresses_even_when_one_position_exceeds_the_cap(tiny_checkpoint):
    """A cap smaller than one position's cost still starts one position per chunk (no livelock)."""
    path = tiny_checkpoint(seed=21, max_position_embeddings=1024)
    tiny = dict(decode_step_ratio=1.01, step_overhead_tokens=1, attention_tokens=8)  # cap 0.04
    engine = chunked_engine(path, budget=64, smoothness=tiny)
    log = RowLog()
    engine.add_observer(log)
    engine.add_request("d0", prompts((5,), seed=4)[0], DECODE)
    for _ in range(5):
        engine.step()
    p = prompts((12,), seed=3)[0]
    engine.add_request("long", p, GREEDY)
    outs = {}
    while "long" not in outs:
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert {n for st in log.steps[5:] for rid, s, n, _ in st if rid == "long"} == {1}
    assert list(outs["long"].token_ids) == oracle(path, [p], GREEDY)[0][0]


@pytest.mark.parametrize("kwargs,match", [
    (dict(decode_step_ratio=1.0), "--chunked-prefill-decode-step-ratio must be 0 \\(off\\) or a number > 1"),
    (dict(decode_step_ratio=-2), "--chunked-prefill-decode-step-ratio"),
    (dict(decode_step_ratio=True), "--chunked-prefill-decode-step-ratio"),
    (dict(step_overhead_tokens=0), "--chunked-prefill-step-overhead-tokens must be an integer >= 1"),
    (dict(attention_tokens=-1), "--chunked-prefill-attention-tokens must be an integer >= 0"),
])
def test_bad_smoothness_options_name_the_flag(kwargs, match):
    from rlt.prefill.features import ChunkedPrefillOptions

    with pytest.raises(ValueError, match=match):
        ChunkedPrefillOptions(**kwargs)
