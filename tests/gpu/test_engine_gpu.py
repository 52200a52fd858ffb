"""GPU: the engine with the Triton backend, fp32 greedy token-identical to the oracle; and a bf16
end-to-end run on Ouro-1.4B shapes with random weights."""

from __future__ import annotations

import random

import pytest
import torch

from rlt.platform import EngineConfig, LLMEngine, SamplingParams
from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.models.ouro_reference import reference_generate

from gpu_helpers import run_prompts as _run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_engine_triton_fp32_equals_oracle(tiny_checkpoint, layout, threshold):
    torch.backends.cuda.matmul.allow_tf32 = False
    path = tiny_checkpoint(seed=61, head_dim=16, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=threshold)
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cuda", attention_backend="triton",
                                 kv_layout=layout, block_size=16))
    assert eng.selection.name == "triton"
    outs = _run(eng, prompts, sp)
    ck = load_checkpoint(path, dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    for p, o in zip(prompts, outs):
        want = reference_generate(ref, p, max_tokens=8, layout=layout, exit_threshold=threshold)
        assert (list(o.token_ids), list(o.exit_depths)) == (want[0], want[1])


@pytest.mark.parametrize("heads,kv_heads", [(16, 8), (48, 8), (20, 4)], ids=["16+8", "nanbeige-48+8", "20+4"])
def test_gqa_head_shapes_prefill_through_the_triton_kernels(tiny_checkpoint, heads, kv_heads):
    """Prompts over 128 tokens take the separate RoPE kernel, whose launch shape follows the head
    count (16 + 8 and 48 + 8 rotated heads once asked Triton for 3 and 7 warps, which it refuses,
    aborting the step): every GQA shape of the supported families must run, oracle-exact in fp32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    path = tiny_checkpoint(seed=7, head_dim=128, hidden_size=256, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, max_position_embeddings=1024)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (150, 290)]
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cuda", attention_backend="triton"))
    outs = _run(eng, prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    ck = load_checkpoint(path, dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    for p, o in zip(prompts, outs):
        assert o.error is None, o.error
        assert list(o.token_ids) == reference_generate(ref, p, max_tokens=6)[0]


def test_bf16_ouro_1p4b_shapes_end_to_end(tmp_path):
    from rlt.platform.checkpoint.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "ouro14", seed=0, vocab_size=320, hidden_size=2048, intermediate_size=5632,
                                 num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
                                 max_position_embeddings=4096, rope_theta=1e6, torch_dtype="bfloat16")
    eng = LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", device="cuda", max_num_seqs=8, num_kv_blocks=512))
    prompts = [[random.Random(i).randrange(3, 320) for _ in range(100 + 37 * i)] for i in range(4)]
    outs = _run(eng, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 16 and all(0 <= t < 320 for t in o.token_ids) for o in outs)
    # the same prompts one at a time give the same greedy tokens except for bf16 near-ties; require most to agree
    solo = [_run(LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", device="cuda", max_num_seqs=1,
                                        num_kv_blocks=512)), [p], SamplingParams(max_tokens=16, temperature=0.0,
                                                                                  ignore_eos=True))[0]
            for p in prompts[:2]]
    agree = sum(a == b for s, o in zip(solo, outs) for a, b in zip(s.token_ids, o.token_ids))
    assert agree >= 24  # of 32 tokens: tolerance for bf16 batch-shape rounding differences
