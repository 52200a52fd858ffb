"""Repetition / frequency / presence penalties: the vectorised form against the oracle's token-by-token
one, greedy engine output against the oracle's penalised greedy generation (mixed with unpenalised
requests and slot reuse), ranges."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine_helpers import drain, reference_for
from rlt.platform import EngineConfig, LLMEngine, SamplingParams
from rlt.platform.engine.penalties import PenaltyBatch, apply_penalties
from rlt.platform.errors import InvalidRequestError
from rlt.platform.models.ouro_reference import penalised, reference_generate

SETTINGS = [(0.0, 0.0, 2.0), (0.0, 0.0, 0.5), (1.5, 0.0, 1.0), (0.0, 1.25, 1.0), (-0.5, 0.75, 1.5), (2.0, -2.0, 1.0)]


def test_vectorised_penalties_equal_the_token_by_token_definition():
    rng = random.Random(0)
    vocab, m = 40, len(SETTINGS)
    logits = torch.randn(m, vocab) * 3
    logits[0, 5] = float("-inf")  # a suppressed token stays suppressed
    histories = [([rng.randrange(vocab) for _ in range(rng.randint(0, 8))],
                  [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]) for _ in range(m)]
    counts = torch.zeros(m, vocab, dtype=torch.int32)
    prompt = torch.zeros(m, vocab, dtype=torch.bool)
    for i, (p, out) in enumerate(histories):
        prompt[i, p] = True
        counts[i] = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=vocab).int()
    pres, freq, rep = (torch.tensor(col, dtype=torch.float32) for col in zip(*SETTINGS))
    got = apply_penalties(logits, PenaltyBatch(torch.arange(m), counts, prompt, pres, freq, rep))
    for i, ((p, out), s) in enumerate(zip(histories, SETTINGS)):
        assert torch.equal(got[i], penalised(logits[i], p, out, *s)), (i, s)
    assert got[0, 5] == float("-inf")
    assert not torch.equal(got, logits)


def test_extreme_repetition_penalties_stay_finite():
    """The smallest and largest accepted penalties saturate penalised logits at +-SATURATE (a banned token
    stays -inf), so that a sampled row's logits stay finite after temperature down to its floor."""
    from rlt.platform.engine.penalties import SATURATE
    from rlt.platform.engine.sampler import SamplingBatch, sampling_logits, suppressed_logits
    from rlt.platform.sampling_params import FLOAT32_MAX, FLOAT32_TINY

    logits = torch.tensor([[5.0, -2.0, float("-inf"), 1.0]] * 2)
    seen = torch.tensor([[True, True, True, False]] * 2)
    pb = PenaltyBatch(torch.arange(2), torch.zeros(2, 4, dtype=torch.int32), seen, torch.zeros(2), torch.zeros(2),
                      torch.tensor([FLOAT32_TINY, FLOAT32_MAX], dtype=torch.float32))
    got = apply_penalties(logits, pb)
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    assert got.tolist() == [[float(f32(SATURATE)), float(f32(-2.0) * f32(FLOAT32_TINY)), float("-inf"), 1.0],
                            [float(f32(5.0) / f32(FLOAT32_MAX)), float(f32(-SATURATE)), float("-inf"), 1.0]]
    m = 2
    full = lambda v: torch.full((m,), v, dtype=torch.float32)  # noqa: E731
    batch = SamplingBatch(temperature=full(1e-6), top_p=full(0.9), top_k=torch.zeros(m, dtype=torch.int64),
                          min_p=None, seed_lo=torch.arange(m), seed_hi=torch.zeros(m, dtype=torch.int64),
                          step=torch.zeros(m, dtype=torch.int64), suppress=None, bias_ids=None, bias_vals=None,
                          all_greedy=False, any_top=True, any_min_p=False, max_logprobs=-1, penalties=pb)
    scaled = sampling_logits(suppressed_logits(logits, batch), batch)
    assert not torch.isnan(scaled).any() and not (scaled == float("inf")).any()
    assert torch.isfinite(torch.softmax(scaled, -1)).all()


def _engine(path, **kw):
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4, **kw))


def _greedy(**penalties):
    return SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, **penalties)


def test_greedy_penalised_requests_equal_the_penalised_oracle(tiny_checkpoint):
    """Requests with different penalties share steps with unpenalised ones; each equals the oracle's greedy
    generation with its own penalties (and the penalties change the output, so the test can fail)."""
    path = tiny_checkpoint(seed=21)
    ref = reference_for(path)
    prompts = [[4, 9, 4, 9, 17], [30, 31, 30], [7, 7, 7, 7, 8, 2], [11, 60, 12]]
    eng = _engine(path, max_num_seqs=3)  # fewer slots than requests: slots are reused
    reqs = []
    for i, s in enumerate(SETTINGS + [(0.0, 0.0, 1.0)]):
        prompt = prompts[i % len(prompts)]
        sp = _greedy(presence_penalty=s[0], frequency_penalty=s[1], repetition_penalty=s[2])
        eng.add_request(f"r{i}", prompt, sp)
        reqs.append((f"r{i}", prompt, s))
    outs = drain(eng)
    changed = 0
    for rid, prompt, s in reqs:
        want, _ = reference_generate(ref, prompt, max_tokens=14, penalties=s)
        assert list(outs[rid].token_ids) == want, (rid, s)
        changed += want != reference_generate(ref, prompt, max_tokens=14)[0]
    assert changed >= 4  # most settings change this model's greedy text


def test_a_reused_slot_starts_from_its_own_history(tiny_checkpoint):
    """One slot, two penalised requests in turn: the second's penalties see only its own prompt and output."""
    path = tiny_checkpoint(seed=21)
    ref = reference_for(path)
    eng = _engine(path, max_num_seqs=1)
    s = (0.5, 1.0, 1.5)
    sp = _greedy(presence_penalty=s[0], frequency_penalty=s[1], repetition_penalty=s[2])
    for rid, prompt in (("a", [4, 9, 4, 9, 17]), ("b", [30, 31, 30])):
        eng.add_request(rid, prompt, sp)
    outs = drain(eng)
    for rid, prompt in (("a", [4, 9, 4, 9, 17]), ("b", [30, 31, 30])):
        assert list(outs[rid].token_ids) == reference_generate(ref, prompt, max_tokens=14, penalties=s)[0]


def test_sampled_rows_draw_from_the_penalised_distribution():
    """Random rows draw from softmax(penalised logits / temperature)."""
    from rlt.platform.engine.sampler import SamplingBatch, sample

    m, vocab = 20000, 4
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]]).expand(m, -1)
    counts = torch.tensor([[0, 2, 0, 1]], dtype=torch.int32).expand(m, -1)
    prompt = torch.tensor([[True, False, False, True]]).expand(m, -1)
    full = lambda v: torch.full((m,), v, dtype=torch.float32)  # noqa: E731
    pb = PenaltyBatch(torch.zeros(m, dtype=torch.int64), counts, prompt, full(0.25), full(0.5), full(2.0))
    batch = SamplingBatch(temperature=full(0.8), top_p=full(1.0), top_k=torch.zeros(m, dtype=torch.int64),
                          min_p=None, seed_lo=torch.arange(m), seed_hi=torch.zeros(m, dtype=torch.int64),
                          step=torch.zeros(m, dtype=torch.int64), suppress=None, bias_ids=None, bias_vals=None,
                          all_greedy=False, any_top=False, any_min_p=False, max_logprobs=-1, penalties=pb)
    freq = np.bincount(sample(logits, batch).token_ids.numpy(), minlength=vocab) / m
    z = penalised(logits[0], [0, 3], [1, 1, 3], 0.25, 0.5, 2.0)
    assert z.tolist() == [2.0 / 2, 1.0 / 2 - 2 * 0.5 - 0.25, 0.5, -1.0 * 2 - 0.5 - 0.25]
    want = torch.softmax(z / 0.8, -1).numpy()
    assert np.abs(freq - want).max() < 0.015


def test_seeded_sampled_requests_with_penalties_are_reproducible(tiny_checkpoint):
    """Through the engine at a low temperature (near-greedy, so the penalties decide tokens): the same seed
    gives the same tokens, and not those of the same seed without the penalties."""
    path = tiny_checkpoint(seed=21)
    cool = SamplingParams(max_tokens=12, temperature=0.05, seed=7, ignore_eos=True)
    runs = []
    for sp in (cool, cool.with_(repetition_penalty=2.0, frequency_penalty=1.0),
               cool.with_(repetition_penalty=2.0, frequency_penalty=1.0)):
        eng = _engine(path)
        eng.add_request("s", [4, 9, 4, 9], sp)
        runs.append(drain(eng)["s"].token_ids)
    assert runs[1] == runs[2] and runs[0] != runs[1]


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.01), ("presence_penalty", float("nan")), ("frequency_penalty", -3),
    ("frequency_penalty", "1"), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")), ("repetition_penalty", 10**400), ("repetition_penalty", 5e-324),
])
def test_out_of_range_penalties_name_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=f"^{field}: ") as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_penalised_flag():
    assert not SamplingParams().penalized and not SamplingParams(repetition_penalty=1).penalized
    assert SamplingParams(presence_penalty=-0.1).penalized and SamplingParams(repetition_penalty=1.01).penalized
    assert SamplingParams(frequency_penalty=2).penalized


def test_unpenalised_steps_allocate_nothing_per_step(tiny_checkpoint):
    """The token history is built once with the sampler; steps without a penalised row never touch it."""
    eng = _engine(tiny_checkpoint(seed=21), max_num_seqs=2)
    state = eng.ctx.parts.sampler.penalties
    assert state.counts.shape == (2, eng.ctx.shape.vocab_size) and state.nbytes == 2 * eng.ctx.shape.vocab_size * 5
    assert eng.describe()["sampler"]["penalty_history_mib"] == round(state.nbytes / 2**20, 2)
    eng.add_request("g", [4, 5], _greedy())
    drain(eng)
    assert int(state.counts.sum()) == 0 and not state.prompt.any()
    eng.add_request("p", [4, 5], _greedy(frequency_penalty=1.0))
    drain(eng)
    assert int(state.counts.sum()) == 14 and int(state.prompt.sum()) == 2


def test_a_sampler_without_a_token_history_refuses_penalised_requests(tiny_checkpoint):
    """A feature's sampler that keeps no token history (no ``penalties``) must not drop penalties silently."""
    from rlt.platform.engine.assembly import EngineAssembly
    from rlt.platform.engine.sampler import build_sampling_batch, sample
    from rlt.platform.platforms import detect_platform

    class HistorylessSampler:
        def __init__(self, ctx):
            self.table, self.uploader = ctx.parts.slots, ctx.parts.uploader

        def sample(self, logits, slots):
            return sample(logits, build_sampling_batch(self.table, slots, self.uploader))

    config = EngineConfig(model=str(tiny_checkpoint(seed=21)), dtype="float32", block_size=4)
    assembly = EngineAssembly(detect_platform(config.device))
    assembly.replace("sampler", HistorylessSampler, by="test")
    eng = assembly.build_engine(config)
    for field, value in (("repetition_penalty", 1.2), ("presence_penalty", 0.5), ("frequency_penalty", -1.0)):
        with pytest.raises(InvalidRequestError, match=f"^{field}: .*keeps no token history") as info:
            eng.add_request("p", [4, 5], _greedy(**{field: value}))
        assert info.value.param == field
    eng.add_request("g", [4, 5], _greedy())
    assert len(drain(eng)["g"].token_ids) == 14


def test_one_upload_per_penalised_step_and_pending_rebuilds():
    """A penalised step's parameters ride in its one sampling upload; a slot's pending history rebuild is
    dropped when an unpenalised request takes the slot, and survives a failed rebuild of another slot."""
    from types import SimpleNamespace

    from rlt.platform.engine.sampler import TokenSampler
    from rlt.platform.engine.slots import SlotTable
    from test_sampling import _Uploads

    table = SlotTable(3)
    req = lambda prompt, **kw: SimpleNamespace(  # noqa: E731
        params=SamplingParams(temperature=0.7, seed=1, **kw), stop_token_ids=(), min_loops=1, max_loops=4,
        exit_threshold=1.0, seed=1, prompt_token_ids=prompt, output_token_ids=[])
    up = _Uploads()
    sampler = TokenSampler(slots=table, uploader=up, vocab_size=8, device=torch.device("cpu"))
    table.assign(0, req([1, 2], repetition_penalty=1.5))
    table.assign(1, req([3], frequency_penalty=1.0))
    table.assign(1, req([3]))  # slot 1 reassigned, unpenalised: its pending rebuild goes
    assert list(table.penalty_resets) == [0]
    sampler.sample(torch.zeros(2, 8), np.array([0, 1]))
    assert len(up.calls) == 1 and {"pen_slots", "presence", "frequency", "repetition"} <= set(up.calls[0])
    assert sampler.penalties.prompt[0].tolist() == [False, True, True] + [False] * 5 and not table.penalty_resets
    assert int(sampler.penalties.counts[0].sum()) == 1  # its sampled token counted
    table.assign(2, req([9], presence_penalty=1.0))  # 9: outside this 8-token vocabulary, the rebuild fails
    table.assign(1, req([4], presence_penalty=1.0))
    with pytest.raises(IndexError):
        sampler.sample(torch.zeros(1, 8), np.array([1]))
    assert set(table.penalty_resets) == {1, 2}  # neither was rebuilt: both stay pending
    table.assign(2, req([5], presence_penalty=1.0))
    sampler.sample(torch.zeros(2, 8), np.array([1, 2]))
    assert not table.penalty_resets and sampler.penalties.prompt[1, 4] and sampler.penalties.prompt[2, 5]
