"""rlt-prefill on the GPU: chunk-size invariance (fp32 Triton vs the oracle), bf16 drift of chunked
vs full prefill (measured and printed), FlashAttention for prompt rows under adaptive exit (when
FA4 imports), and prefill_uva's kernel reading pinned host memory through UVA."""

from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest
import torch

from engine_driver import run_arrivals as _run
from gpu_helpers import FA_BF16_BOUND_NAT, first_token_gap

pytestmark = pytest.mark.gpu


def _prompts(lengths, seed=0, vocab=320):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _engine(path, dtype, *, chunk=0, wavefront=False, budget=None, packed=False, prompt_backend=None, **cfg):
    from rlt.platform import EngineConfig
    from rlt.platform.composition import build_engine
    from rlt.prefill.features import FEATURES, ChunkedPrefillOptions, PackedPrefillOptions

    config = EngineConfig(model=str(path), dtype=dtype, device="cuda", max_num_batched_tokens=budget, **cfg)
    opts = {"chunked_prefill": ChunkedPrefillOptions(chunk_size=chunk, wavefront=wavefront),
            "packed_prefill": PackedPrefillOptions(prompt_backend=prompt_backend or "auto")}
    return build_engine(config, features=FEATURES, enabled={"chunked_prefill": True, "packed_prefill": packed,
                                                            "prefill_uva": False}, options=opts)


@pytest.mark.parametrize("chunk,budget,wavefront", [
    pytest.param(c, b, wf, id=f"chunk{c or 'whole'}-{'wavefront' if wf else 'sequential'}")
    for c, b in [(1, 4), (3, 8), (16, 40), (128, 140), (512, 530), (0, None)] for wf in ((False, True) if c else (False,))])
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_fp32_chunk_size_invariance_triton(tiny_checkpoint, chunk, budget, wavefront, kv_heads):
    from rlt.platform import SamplingParams
    from rlt.platform.checkpoint import load_checkpoint
    from rlt.platform.models.ouro_reference import reference_generate

    path = tiny_checkpoint(seed=21, num_key_value_heads=kv_heads, max_position_embeddings=1024)
    lengths = {1: (9, 5, 13), 3: (17, 4, 26), 16: (70, 9, 41)}.get(chunk, (700, 33, 520))
    prompts = _prompts(lengths, seed=chunk)
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine = _engine(path, "float32", chunk=chunk, wavefront=wavefront, budget=budget, block_size=16,
                     attention_backend="triton")
    outs = _run(engine, prompts, sp, arrive_every=2)
    ck = load_checkpoint(path, dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == reference_generate(ref, p, max_tokens=5)[0]


def _ouro_shapes(tmp_path, kv_heads=16):
    from rlt.platform.checkpoint.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path / "ouro14", seed=0, vocab_size=320, hidden_size=2048,
                                 intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
                                 num_key_value_heads=kv_heads, head_dim=128, max_position_embeddings=8192,
                                 rope_theta=1e6, torch_dtype="bfloat16", gate_bias=1.0)


def test_bf16_drift_chunked_vs_full_prefill_is_measured(tmp_path):
    """bf16 changes rounding with the chunk shape; the drift is printed (the report), bounded loosely."""
    from rlt.platform import SamplingParams

    path = _ouro_shapes(tmp_path)
    prompts = _prompts((1500, 700, 2100), seed=3)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5)
    full = _run(_engine(path, "bfloat16", num_kv_blocks=2048), prompts, sp)
    for chunk, wf in ((128, False), (512, False), (512, True)):
        outs = _run(_engine(path, "bfloat16", chunk=chunk, wavefront=wf, budget=chunk + 64, num_kv_blocks=2048),
                    prompts, sp)
        worst, agree, total = first_token_gap(full, outs)
        print(f"bf16 drift chunk={chunk} wavefront={wf}: max |first-token logprob diff| {worst:.4f} nat, "
              f"greedy agreement before divergence {agree}/{total}")
        assert worst < 0.1


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="FlashAttention-4 not installed")
def test_fa4_prompt_rows_under_adaptive_exit_match_triton(tmp_path):
    """packed_prefill with FA4 for prompt rows, adaptive exit on: within the bf16 bound of the FA tests
    (``FA_BF16_BOUND_NAT``; the semantics are proven exact in fp32 on CPU by ``test_row_groups.py``)."""
    from rlt.platform import SamplingParams
    from rlt.prefill.row_groups import PromptRowGroups

    path = _ouro_shapes(tmp_path, kv_heads=8)
    prompts = _prompts((1000, 300, 1700, 64), seed=5)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5, exit_threshold=0.6)
    kw = dict(chunk=256, wavefront=True, budget=512, num_kv_blocks=2048)
    triton = _run(_engine(path, "bfloat16", attention_backend="triton", **kw), prompts, sp, arrive_every=3)
    engine = _engine(path, "bfloat16", attention_backend="triton", packed=True, prompt_backend="fa4", **kw)
    assert isinstance(engine.ctx.parts.executor.attention, PromptRowGroups)
    fa = _run(engine, prompts, sp, arrive_every=3)
    worst, agree, total = first_token_gap(triton, fa)
    print(f"fa4 prompt rows vs triton: max first-token logprob diff {worst:.4f} nat, greedy {agree}/{total}")
    assert worst < FA_BF16_BOUND_NAT and agree >= total * 3 // 4


def test_prefill_uva_kernel_reads_pinned_host_memory():
    from rlt.platform.platforms import detect_platform
    from rlt.platform.uva import decide_uva
    from rlt.prefill.uva_uploader import StagingUploader

    decision = decide_uva(detect_platform("cuda"))
    print("uva:", decision)
    up = StagingUploader(torch.device("cuda"), mapped=decision.enabled)
    arrays = {"a": np.arange(3000, dtype=np.int64) - 7, "b": np.linspace(0, 1, 11, dtype=np.float32),
              "c": np.arange(12, dtype=np.int32).reshape(3, 4)}
    for _ in range(5):  # more uploads than banks: reuse waits on the bank's event
        out = up.upload(arrays)
    torch.cuda.synchronize()
    for name, a in arrays.items():
        assert np.array_equal(out[name].cpu().numpy(), a)
    assert (up.num_mapped if decision.enabled else up.num_copied) == 5
