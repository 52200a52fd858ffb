"""rlt-decode's static decode path on CPU: composed through the feature contract, token-identical
to the oracle and to the base engine in fp32 (greedy and seeded sampling), with padding to row
buckets, arrivals and aborts mid-decode, adaptive exit with per-request bounds, both KV layouts,
stop tokens and max_tokens. Graph capture is absent on CPU (with its reason); the same buffers
and step function run eagerly, which is what CI checks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rlt.platform import EngineConfig, LLMEngine, SamplingParams
from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.composition import build_engine
from rlt.platform.models.ouro_reference import reference_generate

from engine_driver import run_arrivals as run


def prompts(n, seed, lo=3, hi=12):
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def engines(path, **kw):
    config = EngineConfig(model=str(path), dtype="float32", block_size=4, **kw)
    static = build_engine(config, enabled={"static_buffers": True})
    return LLMEngine(config), static


class Steps:
    def __init__(self):
        self.kinds = []

    def on_step(self, batch, result):
        self.kinds.append(type(batch).__name__)


def test_feature_table_on_cpu(tiny_checkpoint):
    _, static = engines(tiny_checkpoint(seed=1))
    rows = {s.name: s for s in static.features}
    assert rows["static_buffers"].enabled and not rows["graphs"].available
    assert rows["graphs"].reason == "cpu lacks graph_capture"
    info = static.describe()
    assert info["executor"]["static_buffers"] and info["executor"]["graphs"] is False
    assert info["executor"]["graphs_off_reason"] == "platform lacks graph_capture"
    assert info["components"]["executor"] == ["base", "static_buffers"]  # graphs is absent here


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("batch", [1, 3, 6])
def test_greedy_equals_oracle(tiny_checkpoint, layout, batch):
    path = tiny_checkpoint(seed=1)
    base, static = engines(path, kv_layout=layout)
    steps = Steps()
    static.add_observer(steps)
    ps = prompts(batch, seed=batch, lo=2 if layout == "shared" else 3, hi=7 if layout == "shared" else 12)
    sp = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    got = run(static, ps, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in run(base, ps, sp)]
    ck = load_checkpoint(path, dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    for p, o in zip(ps, got):
        want, depths = reference_generate(ref, p, max_tokens=7, layout=layout)
        assert list(o.token_ids) == want and list(o.exit_depths) == depths
    assert "DecodeBatch" in steps.kinds and "StepBatch" in steps.kinds  # decode steps took the static path
    info = static.describe()["executor"]
    assert info["steps"]["eager_decode_steps"] > 0 and 2 ** int(np.ceil(np.log2(batch))) in info["row_buckets"]


def test_adaptive_exit_bounds_arrivals_and_aborts(tiny_checkpoint):
    path = tiny_checkpoint(seed=6, gate_bias=0.5)
    base, static = engines(path)
    ps = prompts(5, seed=9)
    params = [SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, exit_threshold=t, min_loops=lo,
                             max_loops=hi) for t, lo, hi in [(0.5, 1, None), (0.7, 2, 4), (1.0, 1, 3), (0.3, 1, 2),
                                                              (0.0, 2, 3)]]
    want = run(base, ps, params, arrive_every=3, abort=("r2", 9))
    got = run(static, ps, params, arrive_every=3, abort=("r2", 9))
    for a, b in zip(want, got):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.token_ids == b.token_ids and a.exit_depths == b.exit_depths
            assert a.finish_reason == b.finish_reason
    assert len({d for o in got if o for d in o.exit_depths}) > 1  # rows really exited at different depths


def test_seeded_sampling_stop_ids_and_lengths(tiny_checkpoint):
    path = tiny_checkpoint(seed=2)
    base, static = engines(path)
    ps = prompts(4, seed=3)
    first = run(base, ps[:1], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    stop = first.token_ids[2]
    params = [SamplingParams(max_tokens=5 + i, temperature=0.8, top_p=0.9, seed=100 + i) for i in range(3)]
    params.append(SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop]))
    for a, b in zip(run(base, ps, params), run(static, ps, params)):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and a.stop_reason == b.stop_reason


def test_bad_bucket_option_is_a_clear_error(tiny_checkpoint):
    from rlt.decode.feature import StaticBufferOptions

    with pytest.raises(ValueError, match="row-buckets"):
        StaticBufferOptions(row_buckets="4,x")
    engine = build_engine(EngineConfig(model=str(tiny_checkpoint(seed=1)), dtype="float32", max_num_seqs=8),
                          options={"static_buffers": StaticBufferOptions(row_buckets="2,5,99")})
    assert engine.describe()["executor"]["row_buckets"] == [2, 5, 8]


def test_context_buckets_are_every_bucket_a_step_can_get():
    from rlt.decode.batch import context_bucket, context_buckets

    for limit in (100, 256, 2048, 3000):
        buckets = context_buckets(limit)
        assert list(buckets) == sorted(set(buckets)) and buckets[-1] == limit
        assert {context_bucket(n, limit) for n in range(1, limit + 1)} == set(buckets)


MAPPED_SCRIPT = """
import numpy as np, torch
from rlt.decode.batch import I32, I64, StaticDecodeBuffers
for mapped in (True, False):
    buf = StaticDecodeBuffers(8, torch.device("cpu"), num_slots=4, planes=2, pages=3, mapped=mapped)
    rng = np.random.default_rng(0)
    for b in (8, 3):  # a full bank, then a shorter one over it
        i64 = rng.integers(-2**40, 2**40, (len(I64), b))
        i32 = rng.integers(-2**30, 2**30, (len(I32), b))
        buf.upload(i64, i32)
        f = buf.fields(b)
        for i, name in enumerate(I64):
            assert getattr(f, name).tolist() == i64[i].tolist(), name
        for i, name in enumerate(I32[:-1]):
            assert getattr(f, name).tolist() == i32[i].tolist(), name
    assert (buf.num_mapped, buf.num_copied) == ((2, 0) if mapped else (0, 2))
print("ok")
"""


def test_step_metadata_moves_through_the_mapped_memory_kernel_or_a_copy():
    """With the UVA decision on, the bank is moved by rlt.platform.uva.mapped_copy_ (here in
    Triton's interpreter); off, by a copy; the device fields are the same."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    r = subprocess.run([sys.executable, "-c", MAPPED_SCRIPT], capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
