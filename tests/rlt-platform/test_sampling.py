"""Sampling: seeded reproducibility independent of the batch, filters, stops, logprobs."""

from __future__ import annotations

import math

import attrs

import numpy as np
import pytest
import torch

from rlt.platform import EngineConfig, LLMEngine, SamplingParams
from rlt.platform.errors import InvalidRequestError
from rlt.platform.engine.sampler import SamplingBatch, sample, uniform_noise

from engine_helpers import drain


def _engine(path, **kw):
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4, **kw))


def _run(engine, reqs):
    for rid, prompt, sp in reqs:
        engine.add_request(rid, prompt, sp)
    return drain(engine)


def test_seeded_sampling_independent_of_batch(tiny_checkpoint):
    path = tiny_checkpoint(seed=11)
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = _run(_engine(path), [("a", [5, 6, 7], sp)])["a"]
    others = [(f"o{i}", [9, 10 + i, 11, 12][: 2 + i % 3], SamplingParams(max_tokens=5 + i, temperature=0.9, seed=i, ignore_eos=True))
              for i in range(5)]
    crowded = _run(_engine(path), others[:2] + [("a", [5, 6, 7], sp)] + others[2:])["a"]
    assert alone.token_ids == crowded.token_ids
    other_seed = _run(_engine(path), [("a", [5, 6, 7], sp.with_(seed=99))])["a"]
    assert other_seed.token_ids != alone.token_ids


def test_unseeded_requests_reproducible_per_engine_seed(tiny_checkpoint):
    path = tiny_checkpoint(seed=11)
    sp = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    a = _run(_engine(path, seed=5), [("a", [5, 6], sp)])["a"].token_ids
    b = _run(_engine(path, seed=5), [("a", [5, 6], sp)])["a"].token_ids
    assert a == b


def test_noise_is_uniform_and_depends_on_every_input():
    lo = torch.tensor([1, 1, 2], dtype=torch.int64)
    hi = torch.tensor([0, 0, 0], dtype=torch.int64)
    step = torch.tensor([0, 1, 0], dtype=torch.int64)
    u = uniform_noise(lo, hi, step, 20000)
    assert ((u > 0) & (u < 1)).all()
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])


def _batch(m, temperature=1.0, top_p=1.0, top_k=0, seeds=None, min_p=0.0):
    seeds = seeds if seeds is not None else list(range(m))
    return SamplingBatch(
        temperature=torch.full((m,), temperature), top_p=torch.full((m,), top_p),
        top_k=torch.full((m,), top_k, dtype=torch.int64), min_p=torch.full((m,), min_p),
        seed_lo=torch.tensor(seeds, dtype=torch.int64),
        seed_hi=torch.zeros(m, dtype=torch.int64), step=torch.zeros(m, dtype=torch.int64), suppress=None,
        bias_ids=None, bias_vals=None, all_greedy=temperature == 0, any_top=top_k > 0 or top_p < 1, any_min_p=temperature > 0 and min_p > 0,
        max_logprobs=-1,
    )


def test_sampling_matches_softmax_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    m = 20000
    toks = sample(logits.expand(m, -1), _batch(m)).token_ids
    freq = np.bincount(toks.numpy(), minlength=4) / m
    want = torch.softmax(logits[0], -1).numpy()
    assert np.abs(freq - want).max() < 0.015


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    m = 4000
    k2 = sample(logits.expand(m, -1), _batch(m, top_k=2)).token_ids
    assert set(k2.tolist()) == {0, 1}
    p = torch.softmax(logits[0], -1)
    # top_p just above p0 keeps tokens 0 and 1 only
    tp = sample(logits.expand(m, -1), _batch(m, top_p=float(p[0]) + 0.01)).token_ids
    assert set(tp.tolist()) == {0, 1}
    greedy = sample(logits.expand(3, -1), _batch(3, temperature=0.0)).token_ids
    assert greedy.tolist() == [0, 0, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_best(temperature):
    """vLLM's min-p: after temperature, a token survives iff p >= min_p * max p; the draws follow the
    renormalised distribution over the survivors."""
    logits = torch.tensor([[3.0, 2.5, 1.0, 0.2, -1.0]])
    probs = torch.softmax(logits[0] / temperature, -1)
    min_p = float(probs[2] / probs[0]) + 1e-3  # just above token 2's ratio: tokens 0 and 1 survive
    m = 20000
    toks = sample(logits.expand(m, -1), _batch(m, temperature=temperature, min_p=min_p)).token_ids
    freq = np.bincount(toks.numpy(), minlength=5) / m
    want = torch.where(probs >= min_p * probs[0], probs, 0)
    assert set(toks.tolist()) == {0, 1}
    assert np.abs(freq - (want / want.sum()).numpy()).max() < 0.015
    # min_p 0 filters nothing; min_p 1 keeps only the most likely token
    assert set(sample(logits.expand(m, -1), _batch(m, temperature=temperature, min_p=0.0)).token_ids.tolist()) == set(range(5))
    assert set(sample(logits.expand(64, -1), _batch(64, temperature=temperature, min_p=1.0)).token_ids.tolist()) == {0}


def test_min_p_one_samples_the_greedy_tokens(tiny_checkpoint):
    """min_p = 1 leaves only the argmax (ties aside), so a seeded sampled request equals the greedy one, token for
    token — through admission, the slot table and the sampling batch."""
    eng = _engine(tiny_checkpoint(seed=12))
    prompt = [4, 5, 6, 7]
    greedy = _run(eng, [("g", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))])["g"]
    hot = SamplingParams(max_tokens=8, temperature=1.5, seed=3, ignore_eos=True)
    outs = _run(eng, [("p", prompt, hot.with_(min_p=1.0)), ("q", prompt, hot)])
    assert outs["p"].token_ids == greedy.token_ids
    assert outs["q"].token_ids != greedy.token_ids  # the same seed without min_p draws other tokens


def test_logit_bias_shifts_greedy_and_sampled_rows_but_not_the_reported_logprobs():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 3)
    batch = attrs.evolve(_batch(3, temperature=0.0), max_logprobs=0,
                         bias_ids=torch.tensor([[2, -1], [0, 3], [-1, -1]]),
                         bias_vals=torch.tensor([[2.5, 0.0], [-100.0, 1.5], [0.0, 0.0]]))
    out = sample(logits, batch)
    assert out.token_ids.tolist() == [2, 1, 0]  # 1+2.5 beats 3; token 0 banned, 0+1.5 < 2; row 3 unbiased
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs.tolist() == pytest.approx([float(raw[0, 2]), float(raw[1, 1]), float(raw[2, 0])])  # of the raw logits, as vLLM
    m = 20000  # sampled rows draw from softmax(logits + bias)
    bias = torch.tensor([[1, 3]] * m), torch.tensor([[1.0, 2.5]] * m)
    sb = attrs.evolve(_batch(m), bias_ids=bias[0], bias_vals=bias[1])
    freq = np.bincount(sample(logits[:1].expand(m, -1), sb).token_ids.numpy(), minlength=4) / m
    want = torch.softmax(logits[0] + torch.tensor([0.0, 1.0, 0.0, 2.5]), -1).numpy()
    assert np.abs(freq - want).max() < 0.015


def test_logit_bias_is_checked_and_clamped():
    assert SamplingParams(logit_bias={5: 250, 2: -1e9, 7: 0.5}).logit_bias == ((2, -100.0), (5, 100.0), (7, 0.5))
    assert SamplingParams(logit_bias={1: 10**400, 2: -(10**400)}).logit_bias == ((1, 100.0), (2, -100.0))  # no overflow
    with pytest.raises(InvalidRequestError, match="^temperature: "):
        SamplingParams(temperature=10**400)  # an int too large for a float is out of range, not an OverflowError
    for bad, words in (({-1: 1.0}, "token ids"), ({1: float("nan")}, "finite"), ({True: 1.0}, "token ids"),
                       ({1: "a"}, "finite"), (5, "must map"), ({i: 1.0 for i in range(1025)}, "at most 1024")):
        with pytest.raises(InvalidRequestError, match="^logit_bias: .*" + words):
            SamplingParams(logit_bias=bad)


def test_min_tokens_suppresses_stop_tokens_then_stops(tiny_checkpoint):
    path = tiny_checkpoint(seed=12)
    eng = _engine(path)
    # find the greedy first token, then make it a stop token
    one = _run(eng, [("g", [4, 5, 6], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))])["g"]
    first = one.token_ids[0]
    sp = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[first], ignore_eos=True)
    out = _run(eng, [("s", [4, 5, 6], sp)])["s"]
    assert out.token_ids == (first,) and out.finish_reason == "stop" and out.stop_reason == first
    assert out.text == one.text  # like vLLM, the text keeps a (non-special) stop token
    out = _run(eng, [("m", [4, 5, 6], sp.with_(min_tokens=3))])["m"]
    assert len(out.token_ids) >= 3 and first not in out.token_ids[:3]


def test_eos_stops_unless_ignored(tiny_checkpoint):
    path = tiny_checkpoint(seed=13)
    eng = _engine(path)
    base = _run(eng, [("g", [7, 8], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))])["g"]
    assert base.finish_reason == "length" and len(base.token_ids) == 6
    toks = base.token_ids
    j = next(i for i in range(len(toks)) if toks[i] not in toks[:i] and (i > 0 or len(set(toks)) == 1))
    eng.eos_token_ids = frozenset({toks[j]})
    out = _run(eng, [("e", [7, 8], SamplingParams(max_tokens=6, temperature=0.0))])["e"]
    assert out.finish_reason == "stop" and out.token_ids == toks[: j + 1]
    assert out.stop_reason is None  # EOS, like vLLM


def test_stop_string_truncates_text(tiny_checkpoint):
    path = tiny_checkpoint(seed=14)
    eng = _engine(path)
    base = _run(eng, [("g", "Hello world", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))])["g"]
    assert len(base.text) >= 4
    stop = base.text[2:4]
    out = _run(eng, [("s", "Hello world", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]))])["s"]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.find(stop)]
    kept = _run(eng, [("k", "Hello world", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop],
                                                          include_stop_str_in_output=True))])["k"]
    assert kept.finish_reason == "stop" and kept.stop_reason == stop
    assert kept.text == base.text[: base.text.find(stop) + len(stop)] and kept.token_ids == out.token_ids


def test_logprobs_of_chosen_token_and_top(tiny_checkpoint):
    path = tiny_checkpoint(seed=15)
    eng = _engine(path)
    out = _run(eng, [("l", [3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3))])["l"]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0 and math.isfinite(lp.logprob)
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy: chosen is the best
        assert lp.top[0][1] == pytest.approx(lp.logprob)


class _Uploads:
    """An uploader that records which arrays each call sent (and their shapes)."""

    def __init__(self):
        self.calls = []
        self.shapes = []

    def upload(self, arrays):
        self.calls.append(sorted(arrays))
        self.shapes.append({k: np.asarray(v).shape for k, v in arrays.items()})
        return {k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()}


def test_a_step_uploads_only_as_many_bias_columns_as_its_widest_row():
    """One request with a wide logit_bias widens the slot table for good, but a step without biased rows
    uploads no bias, and one with them only its widest row's columns."""
    from types import SimpleNamespace

    from rlt.platform.engine.sampler import build_sampling_batch
    from rlt.platform.engine.slots import SlotTable

    table = SlotTable(4)
    req = lambda bias: SimpleNamespace(params=SamplingParams(temperature=0.0, logit_bias=bias), stop_token_ids=(),
                                       min_loops=1, max_loops=4, exit_threshold=1.0, seed=0)
    table.assign(0, req({i: 1.0 for i in range(300)}))
    table.assign(1, req({5: 2.0, 9: -3.0}))
    table.assign(2, req({}))
    up = _Uploads()
    assert build_sampling_batch(table, np.array([2, 3]), up).bias_ids is None and up.calls == []
    b = build_sampling_batch(table, np.array([1, 2]), up)
    assert up.shapes[-1]["bias_ids"] == (2, 2) and b.bias_ids.tolist() == [[5, 9], [-1, -1]]
    assert b.bias_vals.tolist() == [[2.0, -3.0], [0.0, 0.0]]
    table.assign(0, req({7: 1.0}))  # the wide request's slot reused: only its own one column
    assert build_sampling_batch(table, np.array([0]), up).bias_ids.tolist() == [[7]]


def test_greedy_batches_upload_only_the_suppression():
    """All-greedy rows need no random-row parameters on the device: nothing is uploaded unless a row
    is still below min_tokens (its stop ids are banned); a random row uploads everything."""
    from rlt.platform.engine.sampler import build_sampling_batch
    from rlt.platform.engine.slots import SlotTable

    Uploads = _Uploads

    table = SlotTable(4, max_stop_ids=2)
    table.temperature[:] = 0.0
    table.stop_ids[:] = [[2, -1]] * 4
    table.min_tokens[:] = 0
    up = Uploads()
    slots = np.array([0, 2])
    greedy = build_sampling_batch(table, slots, up)
    assert up.calls == [] and greedy.all_greedy and greedy.suppress is None and greedy.temperature is None
    table.min_tokens[2] = 3  # slot 2 has generated none: its stop ids are banned
    banned = build_sampling_batch(table, slots, up)
    assert up.calls == [["suppress"]] and banned.suppress.tolist() == [[-1, -1], [2, -1]]
    logits = torch.tensor([[0.0, 0.0, 5.0, 1.0], [0.0, 0.0, 5.0, 1.0]])
    assert sample(logits, banned).token_ids.tolist() == [2, 3]
    table.temperature[0] = 0.7
    build_sampling_batch(table, slots, up)
    assert up.calls[-1] == sorted(["temperature", "top_p", "top_k", "seed_lo", "seed_hi", "step", "suppress"])
    table.min_p[2] = 0.1  # min_p is uploaded only where a row uses it
    build_sampling_batch(table, slots, up)
    assert up.calls[-1] == sorted(["temperature", "top_p", "top_k", "min_p", "seed_lo", "seed_hi", "step", "suppress"])
