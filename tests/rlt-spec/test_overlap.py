"""Overlapped rounds (async_self_spec): the step schedule is the documented chain schedule, rows
of one request at different depths share steps, the steps-per-token formula is the chain's
expectation, adaptive K holds speculation off past ``max_running``, and the feature needs self_spec."""

from __future__ import annotations

import numpy as np
import pytest

from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.composition import build_engine
from rlt.platform.engine.assembly import CompositionError
from rlt.spec.adaptive import async_steps_per_token, best_k, sync_steps_per_token
from rlt.spec.feature import SpecOptions, features
from rlt.spec.rows import CHAIN, PLAIN, row_column
from spec_helpers import drain, spec_engine

D = 4


class Recorder:
    """Per step: (request id, position, depth) of every chain row, the verdicts in order, and the
    positions of decode tokens that plain rows yielded (K shrinks to 0 when one token is left)."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, int, int]]] = []
        self.verdicts: list[bool] = []
        self.plain: list[int] = []

    def on_step(self, batch, result) -> None:
        role = row_column(batch.rows, "role", 0, np.int8)
        self.steps.append([(r.request.request_id, r.start, r.depth) for r, c in zip(batch.rows, role) if c == CHAIN])
        for i in np.nonzero((role == CHAIN) & (result.num_tokens > 0))[0]:
            self.verdicts.append(bool(result.accepted[i]))
        self.plain += [batch.rows[i].start for i in np.nonzero((role == PLAIN) & (result.num_tokens > 0))[0]
                       if not batch.rows[i].in_prompt]


def chain_schedule_steps(verdicts: list[bool], tokens: int, k: int, d: int) -> int:
    """Decode steps of one request yielding ``tokens`` tokens by the documented chain rules (an
    independent replay): a chain starts when none is in flight; the newest row's successor starts
    once it ran ``d`` loops, while at most ``k`` drafts are unverified and the rows in flight do not
    exceed the tokens still to come; the oldest row yields a token after ``D`` loops; a rejection
    drops the chain."""
    ages: list[int] = []
    it = iter(verdicts)
    steps = produced = 0
    while produced < tokens:
        if not ages:
            ages = [0]
        elif ages[-1] >= d and len(ages) <= k and len(ages) < tokens - produced:
            ages.append(0)
        ages = [a + 1 for a in ages]
        steps += 1
        if ages[0] == D:
            produced += 1
            ages.pop(0)
            if not next(it):
                ages = []
    return steps


@pytest.mark.parametrize("k, d", [(1, 1), (2, 1), (8, 1), (1, 2), (4, 2), (2, 3)])
def test_steps_follow_the_chain_schedule(spec_checkpoints, k, d):
    engine = spec_engine(spec_checkpoints[1], overlap=True)
    rec = Recorder()
    engine.add_observer(rec)
    n = 30
    outs = drain(engine, [("r", [5, 17, 42], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                            speculation={"num_tokens": k, "draft_loops": d}))])
    assert len(outs["r"].token_ids) == n
    # every decode token came from a chain row, except the last one when a rejection left only it
    # to come: then K shrinks to 0 and a plain row yields it (the same D steps a chain row would take)
    assert len(rec.verdicts) + len(rec.plain) == n - 1 and len(rec.plain) <= 1
    assert not rec.plain or (rec.plain[0] == 3 + n - 2 and not rec.verdicts[-1])  # the last token's row
    # the prompt runs D steps and yields the first token; every later one comes from the chain
    # (the replay ignores the last token's verdict: a plain last token counts as any)
    assert len(rec.steps) == D + chain_schedule_steps(rec.verdicts + [True] * len(rec.plain), n - 1, k, d)
    assert any(rec.verdicts) and len(rec.steps) < D * n  # drafts were accepted: fewer steps than plain


def test_rows_of_one_request_share_steps_at_different_depths(spec_checkpoints):
    engine = spec_engine(spec_checkpoints[1], overlap=True)
    rec = Recorder()
    engine.add_observer(rec)
    drain(engine, [(f"r{i}", [5 + i, 17, 42], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                             speculation={"num_tokens": 3, "draft_loops": 1}))
                   for i in range(2)])
    shared = 0
    for step in rec.steps:
        for rid in {r for r, _, _ in step}:
            rows = sorted((p, depth) for r, p, depth in step if r == rid)
            # consecutive positions, each newer row at least d = 1 loop shallower than the one before
            assert all(p1 == p0 + 1 and e1 <= e0 - 1 for (p0, e0), (p1, e1) in zip(rows, rows[1:]))
            shared += len(rows) > 1
    assert shared > 0


def _expected_steps(alpha: float, k: int, d: int, n: int = 3000) -> float:
    """E[t_J + D] / E[J + 1] by the chain's start times t_j = max(t_{j-1} + d, t_{j-k-1} + D)."""
    t = []
    for j in range(n):
        v = t[j - 1] + d if j else 0
        if j > k:
            v = max(v, t[j - k - 1] + D)
        t.append(v)
    p = alpha ** np.arange(n) * (1 - alpha)
    return float((p * (np.asarray(t) + D)).sum() / (p * (np.arange(n) + 1)).sum())


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.6, 0.8, 0.95])
@pytest.mark.parametrize("k, d", [(1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (8, 2), (1, 3), (4, 3)])
def test_async_steps_per_token_is_the_chain_expectation(alpha, k, d):
    assert async_steps_per_token(alpha, k, d, D) == pytest.approx(_expected_steps(alpha, k, d), rel=1e-9)


def test_cost_model_values():
    assert async_steps_per_token(1.0, 4, 2, 4) == 2.0  # one token per d steps
    assert async_steps_per_token(1.0, 2, 1, 4) == pytest.approx(4 / 3)  # 3 rows in flight per D steps
    assert async_steps_per_token(0.8, 4, 2, 4) == pytest.approx(2 + 0.2 * 2)
    assert async_steps_per_token(0.0, 4, 2, 4) == 4.0
    assert sync_steps_per_token(1.0, 8, 2, 4) == pytest.approx(20 / 9)
    assert best_k(0.8, 8, 2, 4, 0.05, overlap=True) == 1  # every K >= ceil(D/d) - 1 is as fast: the smallest
    assert best_k(0.8, 8, 1, 4, 0.05, overlap=True) == 3
    assert best_k(0.05, 8, 2, 4, 0.05, overlap=True) == 0
    # a speculative step costing two plain steps: 2.2 x 2 > 4 at d = 2; 1.3 x 2 < 4 at d = 1
    assert best_k(0.9, 8, 2, 4, 0.05, overlap=True, step_cost=2.0) == 0
    assert best_k(0.9, 8, 1, 4, 0.05, overlap=True, step_cost=2.0) == 3


def test_adaptive_k_holds_off_past_max_running(spec_checkpoints):
    """Three requests with max_running = 2: no speculative row while all three run."""
    engine = spec_engine(spec_checkpoints[1], overlap=True, options=SpecOptions(max_running=2, num_tokens=3))
    running, spec_steps = [], []
    engine.add_observer(type("Obs", (), {"on_step": lambda self, b, r: (
        running.append(len({row.request for row in b.rows})),
        spec_steps.append(bool(row_column(b.rows, "role", 0, np.int8).any())))})())
    lengths = [6, 12, 30]
    drain(engine, [(f"r{i}", [5 + i, 17, 42], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                   for i, n in enumerate(lengths)])
    assert not any(s for s, n in zip(spec_steps, running) if n > 2)
    assert any(spec_steps)  # and speculation once two or fewer remain


def test_async_self_spec_needs_self_spec(spec_checkpoints):
    with pytest.raises(CompositionError, match="--self-spec"):
        build_engine(EngineConfig(model=str(spec_checkpoints[0]), dtype="float32"), features=features(),
                     enabled={"async_self_spec": True})


def test_overlapped_seeded_sampling_is_reproducible(spec_checkpoints):
    path = spec_checkpoints[1]
    reqs = [(f"r{i}", [5, 17, 42, 99], SamplingParams(max_tokens=12, temperature=0.8, seed=7 + i, ignore_eos=True,
                                                      speculation={"num_tokens": 4, "draft_loops": 1}))
            for i in range(3)]
    a = drain(spec_engine(path, overlap=True), reqs)
    b = drain(spec_engine(path, overlap=True), reqs[::-1])  # another order, other batch neighbours
    assert {k: list(v.token_ids) for k, v in a.items()} == {k: list(v.token_ids) for k, v in b.items()}


def test_max_decode_rows_bounds_every_step(spec_checkpoints):
    """The scheduler's ``max_decode_rows`` (what a static decode path sizes its buffers by) is one
    row per request plus each speculating request's extra rows — a chain's at most min(K_max + 1, D),
    a round's verification K_max + 1, a wide chain's W (its older position's row and the newest one's
    W candidates) for at most ``wide_lanes`` requests — for at most ``max_running`` speculating
    requests under adaptive K, within the step budget; no step of a full engine exceeds it."""
    from rlt.spec.feature import SpecOptions

    cases = ((True, False, 1, 6, 1, 6 + 6 * 3), (False, False, 1, 6, 1, 6 + 6 * 4), (True, True, 1, 2, 1, 6 + 2 * 3),
             # wide: two lanes, each adding 1 + W - min(K_max + 1, D) rows; chains start wide only while at most
             # two requests run, so two requests (draft depth 2 of 4) run wide
             (True, False, 4, 2, 2, 6 + 6 * 3 + 2 * 1))
    for overlap, adaptive, width, n, d, want in cases:
        engine = spec_engine(spec_checkpoints[1], overlap=overlap, max_num_seqs=6,
                             options=SpecOptions(adaptive=adaptive, max_running=2, max_num_tokens=4, width=width,
                                                 wide_lanes=2))
        sched = engine.ctx.parts.scheduler
        assert sched.max_decode_rows == want, (overlap, adaptive, width)
        widest = []
        engine.add_observer(type("W", (), {"on_step": lambda self, b, r: widest.append(len(b.rows))})())
        reqs = [(f"r{i}", [5 + i, 6, 7], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                       speculation={"num_tokens": 4, "draft_loops": d}))
                for i in range(n)]  # adaptive: the gate is open at 2 running
        drain(engine, reqs)
        assert len(reqs) < max(widest) <= want, (overlap, adaptive, width, max(widest))
        if width > 1:  # the candidates ran: more rows than two plain chains' (at most min(K_max + 1, D) each)
            assert max(widest) > 2 * 4, max(widest)


def test_lag_adds_its_steps_to_every_rejection():
    """Chains read back lagged learn a rejection ``lag`` steps late: d + (1 - a)(D - d + lag) steps
    per token when the chain is never throttled, D + lag at a = 0, unchanged at a = 1."""
    for a in (0.0, 0.3, 0.8):
        for lag in (0, 1, 3):
            assert async_steps_per_token(a, 4, 2, 4, lag) == pytest.approx(2 + (1 - a) * (2 + lag))
    assert async_steps_per_token(1.0, 4, 2, 4, 3) == pytest.approx(async_steps_per_token(1.0, 4, 2, 4, 0))
    # a lag that makes rejections costly enough turns speculation off at moderate acceptance
    assert best_k(0.5, 8, 2, 4, 0.05, overlap=True, lag=0) > 0
    assert best_k(0.5, 8, 2, 4, 0.05, overlap=True, lag=4) == 0


def test_verdict_lag_follows_the_composition():
    """Chains are read back with rlt-decode's pipeline depth, at most ``chain_lag``, when its static buffers
    and pipeline are on, and at once otherwise — also with rlt-kvcache's preemption, before which the
    pipeline drains."""
    from types import SimpleNamespace

    from rlt.spec.feature import CHAIN_LAG, SpecOptions, verdict_lag

    def lag(*names, depth=3, chain_lag=3):
        opts = {n: SimpleNamespace(depth=depth) if n == "pipeline" else object() for n in names}
        return verdict_lag(SimpleNamespace(feature_options=opts), SpecOptions(chain_lag=chain_lag))

    assert lag("static_buffers", "pipeline") == 3
    assert lag("static_buffers", "pipeline", depth=1) == 1
    assert lag("static_buffers", "pipeline", chain_lag=0) == 0
    assert lag("static_buffers", "pipeline", chain_lag=2) == 2
    assert lag("pipeline") == 0 and lag("static_buffers") == 0
    assert lag("static_buffers", "pipeline", "preemption") == 0
    assert SpecOptions().chain_lag == CHAIN_LAG == 1
    with pytest.raises(Exception, match="--self-spec-chain-lag"):
        SpecOptions(chain_lag=-1)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_speculation_counters_reach_the_engine_metrics(spec_checkpoints, overlap):
    """The scheduler's totals (``rlt:spec_*`` on /metrics) count what a step observer counts."""
    from rlt.spec.stats import SpecStats

    engine = spec_engine(spec_checkpoints[1], overlap=overlap)
    seen = SpecStats()
    engine.add_observer(seen)
    reqs = [(f"r{i}", [5 + i, 17, 40 + i, 9], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                         speculation={"num_tokens": 2 + i, "draft_loops": 1 + i % 2}))
            for i in range(3)]
    drain(engine, reqs)
    m = {x.name: x for x in engine.stats().feature_metrics}
    assert seen.rounds > 0 and seen.accepted > 0
    assert (m["spec_rounds"].value, m["spec_draft_tokens"].value, m["spec_accepted_tokens"].value,
            m["spec_rejections"].value) == (seen.rounds, seen.drafted, seen.accepted, seen.rejected)
    assert m["spec_acceptance"].value == pytest.approx(seen.acceptance) and m["spec_acceptance"].kind == "gauge"
