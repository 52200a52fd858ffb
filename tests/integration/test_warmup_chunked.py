"""The engine warm-up under rlt-prefill's chunked prefill with a step budget below max_model_len: besides
its lone prompts of every query tile size, it runs one prompt longer than a step alone, so that prompt's
later chunks (reading the earlier ones from the cache) meet their kernels before serving does; the
engine is left clean and exact afterwards."""

from __future__ import annotations

import random

from engine_driver import run_arrivals
from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.composition import build_engine
from rlt.prefill.features import FEATURES as PREFILL


class _PromptRows:
    """Step observer: per step, the (start, length) of its prompt rows."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[int, int]]] = []

    def on_step(self, batch, result) -> None:
        self.steps.append([(r.start, r.length) for r in batch.rows if r.in_prompt])


def _engine(path):
    cfg = EngineConfig(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=24,
                       max_model_len=96, max_num_seqs=4)
    return build_engine(cfg, features=PREFILL,
                        enabled={"chunked_prefill": True, "packed_prefill": False, "prefill_uva": False})


def test_warm_up_runs_a_chunked_prompt_alone(tiny_checkpoint):
    path = tiny_checkpoint(seed=11)
    engine = _engine(path)
    seen = _PromptRows()
    engine.add_observer(seen)
    free = engine.stats().num_free_kv_blocks
    report = engine.warm_up(max_concurrency=3, max_prompt_len=20, output_len=2)
    assert not report.refused and not report.cut
    assert report.requests == 2 + 1 + 3 + 3  # alone: 16, 20, then 49 tokens (> 24: chunked); arrivals; burst
    # the long prompt's later chunks (every other warm-up prompt is at most 20 tokens), with no other prompt
    later = [rows for rows in seen.steps if any(start >= 24 for start, _ in rows)]
    assert later and all(len(rows) == 1 for rows in later)
    assert not engine.has_unfinished_requests() and engine.stats().num_free_kv_blocks == free
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 40, 13)]
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    want = run_arrivals(_engine(path), prompts, greedy, 1)
    got = run_arrivals(engine, prompts, greedy, 1)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
