"""fp32 greedy output of the engine is token-identical to the in-repo eager reference.

Covers batch sizes 1-8, mixed prompt lengths in one batch, requests arriving while others decode,
1-4 loops, GQA / MHA / MQA, both KV layouts (each against its own reference semantics), adaptive
exit with min/max loop bounds, and small KV pages so prompts cross page boundaries.
"""

from __future__ import annotations

import pytest

from engine_helpers import random_prompts, reference_for, check_against_reference, run_engine
from rlt.platform import EngineConfig, LLMEngine, SamplingParams
from rlt.platform.models.ouro_reference import reference_generate


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_batch_sizes_mixed_lengths(tiny_checkpoint, batch):
    path = tiny_checkpoint(seed=1)
    check_against_reference(path, random_prompts(batch, 320, seed=batch), GREEDY)


@pytest.mark.parametrize("loops", [1, 2, 3, 4])
def test_loop_counts(tiny_checkpoint, loops):
    path = tiny_checkpoint(seed=2, total_ut_steps=loops)
    check_against_reference(path, random_prompts(3, 320, seed=loops), GREEDY)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_gqa_mha_mqa(tiny_checkpoint, kv_heads):
    path = tiny_checkpoint(seed=3, num_key_value_heads=kv_heads)
    check_against_reference(path, random_prompts(4, 320, seed=kv_heads), GREEDY)


def test_arrivals_while_decoding(tiny_checkpoint):
    path = tiny_checkpoint(seed=4)
    outs = check_against_reference(path, random_prompts(6, 320, seed=11), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), arrive_every=3)
    assert all(len(o.token_ids) == 8 for o in outs)


def test_shared_layout_against_its_semantics(tiny_checkpoint):
    path = tiny_checkpoint(seed=5)
    check_against_reference(path, random_prompts(4, 320, seed=5, lo=2, hi=7), GREEDY, layout="shared")


def test_shared_layout_differs_from_last_exited_under_adaptive_exit(tiny_checkpoint):
    """The two layouts have different semantics; with early exits they must actually diverge."""
    path = tiny_checkpoint(seed=6, gate_bias=0.5)
    prompts = random_prompts(4, 320, seed=6, lo=2, hi=6)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, exit_threshold=0.6)
    a = check_against_reference(path, prompts, sp, layout="last_exited")
    b = check_against_reference(path, prompts, sp, layout="shared")
    assert [o.token_ids for o in a] != [o.token_ids for o in b]


@pytest.mark.parametrize("threshold,min_loops,max_loops", [(0.5, 1, None), (0.7, 2, 4), (0.3, 1, 3), (0.0, 2, 3)])
def test_adaptive_exit_follows_gate(tiny_checkpoint, threshold, min_loops, max_loops):
    path = tiny_checkpoint(seed=7, gate_bias=0.0)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=threshold,
                        min_loops=min_loops, max_loops=max_loops)
    outs = check_against_reference(path, random_prompts(5, 320, seed=8), sp)
    for o in outs:
        assert all(min_loops <= d <= (max_loops or 4) for d in o.exit_depths[1:])
    # the gate must actually produce early exits here, or the test proves nothing
    assert any(d < (max_loops or 4) for o in outs for d in o.exit_depths[1:])


def test_mixed_depth_requests_share_steps(tiny_checkpoint):
    """Requests with different loop bounds and thresholds in one batch, each matching the oracle."""
    path = tiny_checkpoint(seed=9)
    prompts = random_prompts(4, 320, seed=9)
    params = [
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, max_loops=2),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, exit_threshold=0.5),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, min_loops=3, exit_threshold=0.4),
    ]
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4))
    outs = run_engine(engine, prompts, params)
    ref = reference_for(path)
    for p, sp, o in zip(prompts, params, outs):
        want, depths = reference_generate(ref, p, max_tokens=6, min_loops=sp.min_loops, max_loops=sp.max_loops,
                                          exit_threshold=sp.exit_threshold or 1.0)
        assert (list(o.token_ids), list(o.exit_depths)) == (want, depths)


def test_oracle_reports_each_tokens_margin(tiny_checkpoint):
    """reference_generate(gaps=...) gives each greedy token's logit margin over the runner-up (how a
    randomised comparison tells an fp32 tie from a wrong token), in both KV layouts."""
    import torch

    from rlt.platform.checkpoint import load_checkpoint

    ck = load_checkpoint(tiny_checkpoint(seed=3), dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    for layout in ("last_exited", "shared"):
        gaps: list[float] = []
        out, _ = reference_generate(ref, [5, 6, 7, 8], max_tokens=6, layout=layout, gaps=gaps)
        assert out == reference_generate(ref, [5, 6, 7, 8], max_tokens=6, layout=layout)[0]
        assert len(gaps) == len(out) and all(g >= 0 for g in gaps) and max(gaps) > 0
