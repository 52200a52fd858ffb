"""Helpers of the rlt-kvcache tests: engines composed with the package's features, the oracle."""

from __future__ import annotations

import random

import torch

from rlt.kvcache.feature import FEATURES
from rlt.kvcache.options import PreemptionOptions, PrefixCacheOptions
from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.composition import build_engine
from rlt.platform.features import Feature
from rlt.platform.models.ouro_reference import reference_generate


def _chunking(limit: int) -> Feature:
    """A test feature that caps prompt chunks, as rlt-prefill does (the policy's ``chunk_limit``)."""

    def cap(ctx, inner):
        inner.chunk_limit = limit
        return inner

    return Feature(name="zz_chunking", package="tests", description="prompt chunks of at most {limit} tokens",
                   install=lambda builder, _options: builder.wrap("scheduler", cap))


def kv_engine(path, *, preemption: PreemptionOptions | None = None, prefix_cache: bool = False,
              chunk_limit: int | None = None, **config):
    """An fp32 engine with the chosen rlt-kvcache features (only those) over ``path``."""
    enabled = {"preemption": preemption is not None, "prefix_cache": prefix_cache}
    options = {}
    if preemption is not None:
        options["preemption"] = preemption
    if prefix_cache:
        options["prefix_cache"] = PrefixCacheOptions()
    config.setdefault("block_size", 4)
    cfg = EngineConfig(model=str(path), dtype="float32", **config)
    extra = [_chunking(chunk_limit)] if chunk_limit is not None else []
    return build_engine(cfg, features=FEATURES, enabled=enabled, options=options, extra_features=extra)


def base_engine(path, **config):
    config.setdefault("block_size", 4)
    return build_engine(EngineConfig(model=str(path), dtype="float32", **config), features=[])


def prompts(n, seed, lo=3, hi=13, vocab=320):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(engine, items, on_step=None):
    """``items``: [(prompt, params)] submitted at once; outputs in order. ``on_step(engine, step)``."""
    for i, (p, sp) in enumerate(items):
        engine.add_request(f"r{i}", p, sp)
    done, step = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        if on_step is not None:
            on_step(engine, step)
        step += 1
    return [done[f"r{i}"] for i in range(len(items))]


_REFS: dict = {}


def reference(path):
    if path not in _REFS:
        ck = load_checkpoint(path, dtype=torch.float32)
        _REFS[path] = ck.family.build_reference(ck.config, ck.weights)
    return _REFS[path]


def assert_matches_reference(path, items, outs, layout="last_exited"):
    ref = reference(path)
    for (p, sp), o in zip(items, outs):
        assert o.error is None, o.error
        want, depths = reference_generate(
            ref, p, max_tokens=sp.max_tokens, layout=layout, min_loops=sp.min_loops, max_loops=sp.max_loops,
            exit_threshold=1.0 if sp.exit_threshold is None else sp.exit_threshold)
        assert list(o.token_ids) == want, f"prompt {p}"
        assert list(o.exit_depths) == depths, f"prompt {p}"


def metrics(engine) -> dict[str, float]:
    return {m.name: m.value for m in engine.stats().feature_metrics}


GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
