"""Helpers shared by the GPU engine tests (plain functions, not fixtures)."""

from __future__ import annotations

import random

#: The bf16 bound of the FlashAttention-vs-Triton engine tests: max |first-token top-5 logprob
#: difference| between two attention kernels on the same bf16 model (kernel-shape rounding, which
#: grows with depth). Measured on the H200: 0.0152 nat (4-layer model, fixed depth), 0.0236 nat
#: (24 layers x 4 loops, FA4 prompt rows under adaptive exit); a kernel reading the wrong KV plane
#: is off by far more (and diverges greedily at once).
FA_BF16_BOUND_NAT = 0.15


def random_prompts(n: int, vocab: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_prompts(engine, prompts, params) -> list:
    """Submit every prompt, step until idle; the finished outputs in prompt order."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params[i] if isinstance(params, list) else params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[f"r{i}"] for i in range(len(prompts))]


def first_token_gap(outs_a, outs_b) -> tuple[float, int, int]:
    """Compare two runs of the same prompts (``logprobs=k`` requested).

    Returns (max |logprob difference| over the first generated token's shared top-k tokens,
    greedy tokens agreeing before the first divergence, tokens compared).
    """
    worst, agree, total = 0.0, 0, 0
    for a, b in zip(outs_a, outs_b):
        first_a, first_b = dict(a.logprobs[0].top), dict(b.logprobs[0].top)
        shared = set(first_a) & set(first_b)
        assert shared, "the first token's top-k share no token"
        worst = max(worst, max(abs(first_a[t] - first_b[t]) for t in shared))
        for x, y in zip(a.token_ids, b.token_ids):
            total += 1
            agree += x == y
            if x != y:
                break
    return worst, agree, total


def run_backends(path, prompts, params, backends, **engine_kw) -> dict:
    """The same prompts through one fresh CUDA engine per attention backend: {backend: outputs}."""
    import torch

    from rlt.platform import EngineConfig, LLMEngine

    results = {}
    for backend in backends:
        engine = LLMEngine(EngineConfig(model=str(path), device="cuda", attention_backend=backend, **engine_kw))
        assert engine.selection.name == backend
        results[backend] = run_prompts(engine, prompts, params)
        del engine
        torch.cuda.empty_cache()
    return results
