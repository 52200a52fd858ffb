"""Prompt logprobs (``SamplingParams.prompt_logprobs``) equal the fp32 oracle's log-softmax at every
prompt position, at full depth and at a lower ``max_loops``, for batches of 1-8 mixed-length prompts
in both KV layouts; the LM head's slicing over positions does not change them."""

from __future__ import annotations

import random

import pytest
import torch

from rlt.platform import EngineConfig, LLMEngine, SamplingParams
from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.engine.prompt_logprobs import prompt_logprobs_for_chunk
from rlt.platform.errors import InvalidRequestError

from engine_helpers import drain

TOP = 3


def _oracle_logp(ref, prompt: list[int], layout: str, max_loops: int) -> torch.Tensor:
    """``[len(prompt), vocab]`` fp32 log-softmax of the oracle's logits at each prompt position."""
    if layout == "last_exited":
        states = ref.forward_last_exited(prompt, [max_loops - 1] * len(prompt), max_loops)[max_loops - 1]
    else:
        cache = [([], []) for _ in range(ref.cfg.num_hidden_layers)]
        states = torch.cat([ref.run_position_shared(cache, t, i, lambda d, h: d + 1 >= max_loops)[-1]
                            for i, t in enumerate(prompt)])
    return torch.log_softmax(ref.logits(states), dim=-1)


def _check(entries, prompt, logp, top):
    assert len(entries) == len(prompt) and entries[0] is None
    for j in range(1, len(prompt)):
        e, row = entries[j], logp[j - 1]
        assert e.token_id == prompt[j]
        torch.testing.assert_close(torch.tensor(e.logprob), row[prompt[j]], rtol=1e-5, atol=1e-5)
        assert e.rank == int((row > row[prompt[j]]).sum()) + 1
        want_lp, want_ids = row.topk(top)
        assert [t for t, _ in e.top] == want_ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in e.top]), want_lp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("max_loops", [None, 2])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_prompt_logprobs_match_oracle(tiny_checkpoint, layout, max_loops, batch):
    path = tiny_checkpoint(seed=5)
    ck = load_checkpoint(path, dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    rng = random.Random(batch * 10 + (max_loops or 0))
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(1, 14))] for _ in range(batch)]
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_layout=layout, block_size=4))
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, max_loops=max_loops, prompt_logprobs=TOP)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
    done = drain(engine)
    for i, p in enumerate(prompts):
        _check(done[f"r{i}"].prompt_logprobs, p, _oracle_logp(ref, p, layout, max_loops or 4), TOP)


def test_first_output_carries_them_and_generation_is_unchanged(tiny_checkpoint):
    path = tiny_checkpoint(seed=5)
    prompt = [7, 8, 9, 10, 11]
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4))
    engine.add_request("a", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=0))
    engine.add_request("b", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    firsts = {}
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            firsts.setdefault(o.request_id, o)
            if o.finished:
                finals[o.request_id] = o
    assert not firsts["a"].finished and firsts["a"].prompt_logprobs is not None
    assert len(firsts["a"].prompt_logprobs) == len(prompt)
    assert all(e.top == () for e in firsts["a"].prompt_logprobs[1:])
    assert finals["a"].prompt_logprobs == firsts["a"].prompt_logprobs
    assert finals["b"].prompt_logprobs is None
    assert finals["a"].token_ids == finals["b"].token_ids


def test_lm_head_slicing_does_not_change_them(tiny_checkpoint):
    path = tiny_checkpoint(seed=5)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4))
    hidden = torch.randn(11, engine.model.shape.hidden_size)
    targets = list(range(3, 14))
    whole = prompt_logprobs_for_chunk(engine.model, hidden, targets, 4, chunk_size=64)
    sliced = prompt_logprobs_for_chunk(engine.model, hidden, targets, 4, chunk_size=3)
    assert [e.token_id for e in sliced] == targets
    for a, b in zip(whole, sliced):
        assert a.rank == b.rank and [t for t, _ in a.top] == [t for t, _ in b.top]
        torch.testing.assert_close(torch.tensor(a.logprob), torch.tensor(b.logprob))
    with pytest.raises(ValueError, match="chunk_size"):
        prompt_logprobs_for_chunk(engine.model, hidden, targets, 0, chunk_size=0)


def test_rejected_by_an_executor_that_cannot_compute_them(tiny_checkpoint):
    from rlt.platform.engine.assembly import EngineAssembly
    from rlt.platform.platforms import detect_platform

    class NoPromptLogprobs:  # a replacement executor that does not declare prompt-logprob support
        exit_latency = 0

        def execute(self, batch):
            raise AssertionError("never runs")

        def release(self, slot):
            pass

    assembly = EngineAssembly(detect_platform("cpu"))
    assembly.replace("executor", lambda ctx: NoPromptLogprobs(), by="test")
    engine = assembly.build_engine(EngineConfig(model=str(tiny_checkpoint(seed=5)), dtype="float32"))
    with pytest.raises(InvalidRequestError, match="prompt_logprobs") as info:
        engine.add_request("a", [3, 4], SamplingParams(prompt_logprobs=1))
    assert info.value.param == "prompt_logprobs"
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_out_of_range_is_an_error(value):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
