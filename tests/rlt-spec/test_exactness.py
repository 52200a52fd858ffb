"""fp32 greedy self-speculation, synchronous and overlapped rounds, is token-identical to the
oracle for every K in 1..8 and every d in 1..D-1, with speculating and plain requests in the same
steps, on random weights (drafts mostly rejected) and on a controlled-acceptance checkpoint (drafts
mostly accepted)."""

from __future__ import annotations

import itertools
import random

import pytest

from rlt.platform import SamplingParams
from rlt.platform.models.ouro_reference import reference_generate
from rlt.spec.stats import SpecStats

from spec_helpers import drain, reference, spec_engine

PAIRS = list(itertools.product(range(1, 9), range(1, 4)))  # K x d for D = 4
MODES = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
_REF: dict = {}


def _oracle(path, prompt, max_tokens):
    """The oracle's tokens and exit depths (cached across the modes)."""
    key = (str(path), tuple(prompt), max_tokens)
    if key not in _REF:
        if str(path) not in _REF:
            _REF[str(path)] = reference(path)
        _REF[key] = reference_generate(_REF[str(path)], prompt, max_tokens=max_tokens)
    return _REF[key]


def _requests(pairs, seed, max_tokens=9):
    rng = random.Random(seed)
    reqs = []
    for i, pair in enumerate(pairs):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randint(2, 11))]
        spec = None if pair is None else {"num_tokens": pair[0], "draft_loops": pair[1]}
        reqs.append((f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                      speculation=spec)))
    return reqs


@MODES
@pytest.mark.parametrize("which", [0, 1], ids=["random", "controlled"])
def test_greedy_exact_every_k_and_d_mixed_with_plain(spec_checkpoints, which, overlap):
    path = spec_checkpoints[which]
    engine = spec_engine(path, overlap=overlap)
    stats = SpecStats()
    engine.add_observer(stats)
    pairs: list = []
    for pair in PAIRS:  # a plain request after every third speculating one
        pairs.append(pair)
        if len(pairs) % 4 == 3:
            pairs.append(None)
    reqs = _requests(pairs, seed=which)
    outs = drain(engine, reqs)
    for rid, prompt, params in reqs:
        want, depths = _oracle(path, prompt, params.max_tokens)
        assert outs[rid].error is None
        assert list(outs[rid].token_ids) == want, (rid, params.speculation)
        assert list(outs[rid].exit_depths) == depths
    assert stats.rounds > 0 and stats.drafted > stats.accepted  # rejections happened
    if which == 1:
        assert stats.acceptance > 0.5  # and acceptances: both paths ran


@MODES
def test_exact_when_the_step_budget_shrinks_rounds(spec_checkpoints, overlap):
    """Four requests at K = 8 under a 12-token step budget: verification rows are cut to fit
    (synchronous), the newest chain rows wait a step (overlapped, d = 1: up to 4 rows each)."""
    path = spec_checkpoints[1]
    engine = spec_engine(path, max_num_batched_tokens=12, overlap=overlap)
    reqs = _requests([(8, 1 if overlap else 2)] * 4, seed=5, max_tokens=12)
    for _, p, _ in reqs:
        assert len(p) <= 12
    widest = []  # tokens per step
    engine.add_observer(type("Widest", (), {"on_step": lambda self, b, r: widest.append(
        sum(row.length for row in b.rows))})())
    outs = drain(engine, reqs)
    for rid, prompt, params in reqs:
        assert list(outs[rid].token_ids) == _oracle(path, prompt, 12)[0]
    assert max(widest) <= 12


@MODES
def test_exact_with_stops_min_tokens_and_logprobs(spec_checkpoints, overlap):
    """Stop tokens inside an accepted run end the request there; min_tokens suppression and
    logprobs match plain decoding position by position."""
    path = spec_checkpoints[1]
    plain_reqs = _requests([None] * 3, seed=9, max_tokens=14)
    base = drain(spec_engine(path, spec=False), [
        (rid, p, params.with_(min_tokens=4, logprobs=2)) for rid, p, params in plain_reqs])
    stop = {rid: base[rid].token_ids[6] for rid in base}  # a token seen after min_tokens
    want = drain(spec_engine(path, spec=False), [
        (rid, p, params.with_(min_tokens=4, logprobs=2, stop_token_ids=(stop[rid],))) for rid, p, params in plain_reqs])
    got = drain(spec_engine(path, overlap=overlap), [
        (rid, p, params.with_(min_tokens=4, logprobs=2, stop_token_ids=(stop[rid],),
                              speculation={"num_tokens": 5, "draft_loops": 2})) for rid, p, params in plain_reqs])
    for rid in want:
        assert list(got[rid].token_ids) == list(want[rid].token_ids)
        assert got[rid].finish_reason == want[rid].finish_reason
        for a, b in zip(got[rid].logprobs, want[rid].logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


@MODES
def test_logit_bias_and_min_p_speculate_as_plain_decoding_samples(spec_checkpoints, overlap):
    """Drafts and verification see the same biased logits as plain decoding: greedy rows with a logit_bias
    (a boosted token, banned ones) are token-identical to plain decoding with it; sampled rows with min_p 1
    (only the argmax survives) equal greedy plain decoding."""
    path = spec_checkpoints[1]
    reqs = _requests([None] * 3, seed=11, max_tokens=12)
    base = drain(spec_engine(path, spec=False), reqs)
    biased = [(rid, p, params.with_(logit_bias={base[rid].token_ids[2]: 4.0, base[rid].token_ids[5]: -100.0}))
              for rid, p, params in reqs]
    want = drain(spec_engine(path, spec=False), biased)
    spec = {"num_tokens": 5, "draft_loops": 2}
    got = drain(spec_engine(path, overlap=overlap), [(rid, p, params.with_(speculation=spec)) for rid, p, params in biased])
    hot = drain(spec_engine(path, overlap=overlap), [
        (rid, p, params.with_(speculation=spec, temperature=1.5, seed=3, min_p=1.0)) for rid, p, params in reqs])
    for rid, _, _ in reqs:
        assert list(got[rid].token_ids) == list(want[rid].token_ids)
        assert list(want[rid].token_ids) != list(base[rid].token_ids)  # the bias changed the output
        assert list(hot[rid].token_ids) == list(base[rid].token_ids)


@MODES
def test_adaptive_k_engine_default_is_exact(spec_checkpoints, overlap):
    """The engine default (every request speculates, adaptive K) changes no token."""
    from rlt.spec.feature import SpecOptions

    path = spec_checkpoints[0]
    reqs = _requests([None] * 4, seed=3, max_tokens=30)
    want = drain(spec_engine(path, spec=False), reqs)  # plain decoding (oracle-exact, tests/rlt-platform)
    engine = spec_engine(path, options=SpecOptions(num_tokens=4, draft_loops=2), overlap=overlap)
    stats = SpecStats()
    engine.add_observer(stats)
    outs = drain(engine, reqs)
    for rid, _, _ in reqs:
        assert list(outs[rid].token_ids) == list(want[rid].token_ids)
    assert stats.rounds > 0
