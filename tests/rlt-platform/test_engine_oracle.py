"""fp32 greedy output of the engine is token-identical to the in-repo eager reference.

Covers batch sizes 1-8, mixed prompt lengths in one batch, requests arriving while others decode,
1-4 loops, GQA / MHA / MQA, both KV layouts (each against its own reference semantics), adaptive
exit with min/max loop bounds, and small KV pages so prompts cross page boundaries.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine_driver import run_arrivals as run_engine
from rlt.platform import EngineConfig, LLMEngine, SamplingParams
from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.models.ouro_reference import reference_generate


def _reference(path):
    ck = load_checkpoint(path, dtype=torch.float32)
    return ck.family.build_reference(ck.config, ck.weights)


def _prompts(n, vocab, seed, lo=3, hi=13):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def check_against_reference(path, prompts, sp: SamplingParams, layout="last_exited", arrive_every=0, **engine_kw):
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_layout=layout, block_size=4, **engine_kw))
    outs = run_engine(engine, prompts, sp, arrive_every)
    ref = _reference(path)
    for p, o in zip(prompts, outs):
        want, depths = reference_generate(
            ref, p, max_tokens=sp.max_tokens, layout=layout, min_loops=sp.min_loops,
            max_loops=sp.max_loops, exit_threshold=1.0 if sp.exit_threshold is None else sp.exit_threshold,
        )
        assert list(o.token_ids) == want, f"prompt {p}"
        assert list(o.exit_depths) == depths, f"prompt {p}"
    return outs


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_batch_sizes_mixed_lengths(tiny_checkpoint, batch):
    path = tiny_checkpoint(seed=1)
    check_against_reference(path, _prompts(batch, 320, seed=batch), GREEDY)


@pytest.mark.parametrize("loops", [1, 2, 3, 4])
def test_loop_counts(tiny_checkpoint, loops):
    path = tiny_checkpoint(seed=2, total_ut_steps=loops)
    check_against_reference(path, _prompts(3, 320, seed=loops), GREEDY)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_gqa_mha_mqa(tiny_checkpoint, kv_heads):
    path = tiny_checkpoint(seed=3, num_key_value_heads=kv_heads)
    check_against_reference(path, _prompts(4, 320, seed=kv_heads), GREEDY)


def test_arrivals_while_decoding(tiny_checkpoint):
    path = tiny_checkpoint(seed=4)
    outs = check_against_reference(path, _prompts(6, 320, seed=11), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), arrive_every=3)
    assert all(len(o.token_ids) == 8 for o in outs)


def test_shared_layout_against_its_semantics(tiny_checkpoint):
    path = tiny_checkpoint(seed=5)
    check_against_reference(path, _prompts(4, 320, seed=5, lo=2, hi=7), GREEDY, layout="shared")


def test_shared_layout_differs_from_last_exited_under_adaptive_exit(tiny_checkpoint):
    """The two layouts have different semantics; with early exits they must actually diverge."""
    path = tiny_checkpoint(seed=6, gate_bias=0.5)
    prompts = _prompts(4, 320, seed=6, lo=2, hi=6)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, exit_threshold=0.6)
    a = check_against_reference(path, prompts, sp, layout="last_exited")
    b = check_against_reference(path, prompts, sp, layout="shared")
    assert [o.token_ids for o in a] != [o.token_ids for o in b]


@pytest.mark.parametrize("threshold,min_loops,max_loops", [(0.5, 1, None), (0.7, 2, 4), (0.3, 1, 3), (0.0, 2, 3)])
def test_adaptive_exit_follows_gate(tiny_checkpoint, threshold, min_loops, max_loops):
    path = tiny_checkpoint(seed=7, gate_bias=0.0)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=threshold,
                        min_loops=min_loops, max_loops=max_loops)
    outs = check_against_reference(path, _prompts(5, 320, seed=8), sp)
    for o in outs:
        assert all(min_loops <= d <= (max_loops or 4) for d in o.exit_depths[1:])
    # the gate must actually produce early exits here, or the test proves nothing
    assert any(d < (max_loops or 4) for o in outs for d in o.exit_depths[1:])


def test_mixed_depth_requests_share_steps(tiny_checkpoint):
    """Requests with different loop bounds and thresholds in one batch, each matching the oracle."""
    path = tiny_checkpoint(seed=9)
    prompts = _prompts(4, 320, seed=9)
    params = [
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, max_loops=2),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, exit_threshold=0.5),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, min_loops=3, exit_threshold=0.4),
    ]
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4))
    outs = run_engine(engine, prompts, params)
    ref = _reference(path)
    for p, sp, o in zip(prompts, params, outs):
        want, depths = reference_generate(ref, p, max_tokens=6, min_loops=sp.min_loops, max_loops=sp.max_loops,
                                          exit_threshold=sp.exit_threshold or 1.0)
        assert (list(o.token_ids), list(o.exit_depths)) == (want, depths)
