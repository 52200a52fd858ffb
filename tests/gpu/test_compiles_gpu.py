"""After the engine warm-up, serving-like traffic compiles no Triton kernel.

A compile stalls the step that meets it for 0.3-2 s, and every running request with it: on the
H200 four compiles in a 15 s window put decode ITL p99 at 1.2-3.6 s under 16K-token arrivals
(``benchmarks/results/h200-20261204-lease5``). The kernels therefore take their per-step integers
(row counts, split counts, block-table and slot-row strides) unspecialised, and the warm-up meets
every constexpr variant. This test composes the engine a server would (rlt-decode's static
buffers and graphs, rlt-prefill's chunked prefill with the decode-smoothness cap, Triton
attention, bf16), warms it up, then drives arrivals with prompt lengths, row counts and contexts
the warm-up never had, and records Triton's post-compile hook: nothing may compile.
"""

from __future__ import annotations

import random

import pytest

from benchmarks.prefill_bench import CompileLog

pytestmark = pytest.mark.gpu


def _engine(path):
    from rlt.decode.feature import FEATURES as DECODE
    from rlt.platform import EngineConfig
    from rlt.platform.composition import plan_composition
    from rlt.platform.platforms import detect_platform
    from rlt.prefill.features import FEATURES as PREFILL, ChunkedPrefillOptions

    config = EngineConfig(model=str(path), dtype="bfloat16", device="cuda", attention_backend="triton",
                          max_num_seqs=24, max_num_batched_tokens=1024, num_kv_blocks=4096)
    plan = plan_composition(detect_platform("cuda"), DECODE + PREFILL,
                            enabled={"chunked_prefill": True, "packed_prefill": False, "prefill_uva": False},
                            options={"chunked_prefill": ChunkedPrefillOptions(decode_step_ratio=1.5)})
    return plan.build_engine(config)


def test_no_triton_compile_after_warm_up(tmp_path):
    from rlt.platform import SamplingParams
    from rlt.platform.checkpoint.tiny import write_tiny_checkpoint
    from rlt.platform.engine.warmup import warm_up

    path = write_tiny_checkpoint(tmp_path / "m", seed=0, vocab_size=320, hidden_size=512, intermediate_size=1024,
                                 num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                                 max_position_embeddings=8192, torch_dtype="bfloat16", gate_bias=1.0)
    engine = _engine(path)
    report = warm_up(engine, max_concurrency=24, max_prompt_len=1024, output_len=8)
    assert not report.refused and not report.cut
    rng = random.Random(7)
    with CompileLog() as seen:
        pending = [(rng.choice([2, 5, 33, 47, 130, 333, 700, 1023, 1500, 2900]), rng.random() < 0.5) for _ in range(40)]
        n = steps = 0
        while pending or engine.has_unfinished_requests():
            if pending and rng.random() < 0.35:  # arrivals between steps: row counts and contexts drift
                length, adaptive = pending.pop()
                params = SamplingParams(max_tokens=rng.randint(3, 60), temperature=0.0, ignore_eos=True,
                                        exit_threshold=0.7 if adaptive else None)
                engine.add_request(f"r{n}", [rng.randrange(3, 310) for _ in range(length)], params)
                n += 1
            engine.step()
            steps += 1
    assert steps > 100
    compiled = [(name, consts) for _, name, consts in seen.events]
    assert compiled == [], f"{len(compiled)} Triton compile(s) after the warm-up: {compiled[:6]}"
