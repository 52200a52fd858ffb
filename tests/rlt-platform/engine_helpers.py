"""Helpers shared by the rlt-platform engine tests (not fixtures: plain functions)."""

import random

import torch

from rlt.platform import EngineConfig, LLMEngine, SamplingParams
from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.engine.interfaces import Wrapped
from rlt.platform.models.ouro_reference import reference_generate


def drain(engine) -> dict:
    """Step ``engine`` until idle; the finished outputs by request id."""
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return done


class FaultyExecutor(Wrapped):
    """An executor wrapper (installed through the public assembly) that fails while armed."""

    def __init__(self, inner, message: str = "injected device fault") -> None:
        super().__init__(inner)
        self.message, self.armed = message, False

    def execute(self, batch):
        if self.armed:
            raise RuntimeError(self.message)
        return self.inner.execute(batch)


def engine_with_faults(config):
    """``(engine, faults)``: the base engine whose executor is wrapped by a :class:`FaultyExecutor`."""
    from rlt.platform.engine.assembly import EngineAssembly
    from rlt.platform.platforms import detect_platform

    assembly = EngineAssembly(detect_platform(config.device))
    wrapped = {}
    assembly.wrap("executor", lambda ctx, inner: wrapped.setdefault("x", FaultyExecutor(inner)), by="test")
    return assembly.build_engine(config), wrapped["x"]
def reference_for(path):
    ck = load_checkpoint(path, dtype=torch.float32)
    return ck.family.build_reference(ck.config, ck.weights)


def random_prompts(n, vocab, seed, lo=3, hi=13):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_engine(engine, prompts, params, arrive_every: int = 0):
    """Submit prompts (all at once, or one every ``arrive_every`` steps) and collect outputs."""
    outs = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and (arrive_every == 0 or step % arrive_every == 0):
            batch = pending if arrive_every == 0 else pending[:1]
            for i, p in batch:
                engine.add_request(f"r{i}", p, params[i] if isinstance(params, list) else params)
            pending = pending[len(batch):]
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        step += 1
    return [outs[f"r{i}"] for i in range(len(prompts))]


def check_against_reference(path, prompts, sp: SamplingParams, layout="last_exited", arrive_every=0, **engine_kw):
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_layout=layout, block_size=4, **engine_kw))
    outs = run_engine(engine, prompts, sp, arrive_every)
    ref = reference_for(path)
    for p, o in zip(prompts, outs):
        want, depths = reference_generate(
            ref, p, max_tokens=sp.max_tokens, layout=layout, min_loops=sp.min_loops,
            max_loops=sp.max_loops, exit_threshold=1.0 if sp.exit_threshold is None else sp.exit_threshold,
        )
        assert list(o.token_ids) == want, f"prompt {p}"
        assert list(o.exit_depths) == depths, f"prompt {p}"
    return outs
