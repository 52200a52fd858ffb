"""Helpers of the rlt-prefill tests: engines composed with rlt-prefill's features, and the oracle."""

from __future__ import annotations

import random

import torch

from engine_driver import run_arrivals as run  # noqa: F401 - re-exported for the tests
from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.composition import build_engine
from rlt.platform.models.ouro_reference import reference_generate
from rlt.prefill.features import FEATURES, ChunkedPrefillOptions

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def prompts(lengths, vocab=320, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def chunked_engine(path, *, chunk_size=0, wavefront=False, max_inflight_tokens=0, budget=None, layout="last_exited",
                   smoothness=None, **config):
    """``smoothness``: ChunkedPrefillOptions fields of the decode-smoothness cap (decode_step_ratio,
    step_overhead_tokens, attention_tokens); the defaults otherwise."""
    cfg = EngineConfig(model=str(path), dtype=config.pop("dtype", "float32"), kv_layout=layout, block_size=4,
                       max_num_batched_tokens=budget, **config)
    opts = ChunkedPrefillOptions(chunk_size=chunk_size, wavefront=wavefront, max_inflight_tokens=max_inflight_tokens,
                                 **(smoothness or {}))
    return build_engine(cfg, features=FEATURES, enabled={"chunked_prefill": True, "packed_prefill": False,
                                                         "prefill_uva": False},
                        options={"chunked_prefill": opts})


class RowLog:
    """Step observer: every step's rows as (request id, start, length, depth), and the step sizes."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, int, int, int]]] = []

    def on_step(self, batch, result) -> None:
        self.steps.append([(r.request.request_id, r.start, r.length, r.depth) for r in batch.rows])


def oracle(path, prompt_list, sp: SamplingParams, layout="last_exited"):
    ck = load_checkpoint(path, dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    return [reference_generate(ref, p, max_tokens=sp.max_tokens, layout=layout, min_loops=sp.min_loops,
                               max_loops=sp.max_loops,
                               exit_threshold=1.0 if sp.exit_threshold is None else sp.exit_threshold)
            for p in prompt_list]
