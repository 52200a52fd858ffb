"""Engine warm-up (rlt.platform.engine.warmup): it exercises the serving shapes, leaves the engine
as it found it (no request, no page held) and the engine's output afterwards is the oracle's."""

from __future__ import annotations

import pytest

from engine_helpers import check_against_reference, random_prompts, run_engine
from rlt.platform import EngineConfig, LLMEngine, SamplingParams
from rlt.platform.engine.warmup import LENGTHS, alone_lengths

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_warm_up_leaves_the_engine_clean_and_exact(tiny_checkpoint):
    path = tiny_checkpoint(seed=1)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4, max_num_seqs=8))
    free = engine.stats().num_free_kv_blocks
    report = engine.warm_up(max_concurrency=6, max_prompt_len=40, output_len=3)
    assert not report.cut and not report.refused
    assert report.requests == 3 + 6 + 6 and report.steps > 15  # alone: 16, 31, 40
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_free_kv_blocks == free  # every page back
    prompts = random_prompts(4, 320, seed=3)
    want = run_engine(LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4)), prompts, GREEDY)
    got = run_engine(engine, prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_warm_up_lengths_respect_the_engine_limits(tiny_checkpoint):
    """Prompt lengths are capped by max_model_len and the step budget: nothing is refused."""
    path = tiny_checkpoint(seed=2)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4, max_model_len=64,
                                    max_num_batched_tokens=32, max_num_seqs=4))
    report = engine.warm_up(max_concurrency=4)
    assert not report.refused and report.requests == 2 + 4 + 4  # alone: 16, 32


def test_warm_up_falls_back_to_plain_requests_under_fixed_depth(tiny_checkpoint):
    path = tiny_checkpoint(seed=3)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4, fixed_depth=True))
    report = engine.warm_up(max_concurrency=3, max_prompt_len=20, output_len=2)
    assert not report.refused and report.requests == 2 + 3 + 3  # alone: 16, 20


def test_warm_up_deadline_aborts_the_rest(tiny_checkpoint):
    path = tiny_checkpoint(seed=4)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4))
    free = engine.stats().num_free_kv_blocks
    report = engine.warm_up(max_concurrency=4, max_prompt_len=20, deadline_s=0.0)
    assert report.cut and not engine.has_unfinished_requests()
    assert engine.stats().num_free_kv_blocks == free
    check_against_reference(path, random_prompts(2, 320, seed=5), GREEDY)


def test_warm_up_needs_an_idle_engine(tiny_checkpoint):
    path = tiny_checkpoint(seed=5)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4))
    engine.add_request("x", [5, 6, 7], GREEDY)
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.warm_up()


def test_requests_alone_cover_every_prompt_tile():
    """One lone prompt per power-of-two query tile (16 .. 128 rows and up): each is a kernel variant a
    request arriving at an idle server compiles."""
    assert alone_lengths(LENGTHS) == [16, 31, 64, 100, 255, 512, 1024]
    assert alone_lengths([1, 3]) == [3]
    assert alone_lengths([1, 3, 16, 17, 20]) == [16, 20]
