"""Benchmark models: named real Ouro configurations with random weights, written on the fly.

``write_random_checkpoint(path, "ouro-1.4b")`` writes a Hugging Face layout checkpoint (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json) with the real shapes of the named model
(vocab 49152 included) and random weights, so a benchmark on it moves the same bytes and does the
same FLOPs as the real model. Random weights keep shapes and costs, not text quality: the text it
generates is noise, and adaptive-depth exit statistics depend on the gate bias chosen here, not
on anything learned.

The tokenizer is the small byte-level BPE of ``rlt.platform.checkpoint.tiny`` (a few hundred
tokens); the engine only needs tokenizer vocab <= model vocab. Benchmarks feed token ids, so the
tokenizer only detokenizes.

This module owns nothing of the engine: it writes files and returns their directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlt.platform.checkpoint.tiny import CHATML_TEMPLATE, build_tokenizer, tiny_config
from rlt.platform.models.ouro import OuroConfig, ouro_expected_weights

#: Real configurations (models.md §1.1). Only the fields that differ from tiny_config's defaults.
NAMED_CONFIGS: dict[str, dict] = {
    "ouro-1.4b": dict(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                      num_attention_heads=16, num_key_value_heads=16, head_dim=128,
                      max_position_embeddings=65536, rope_theta=1000000.0, total_ut_steps=4,
                      torch_dtype="bfloat16"),
    "ouro-2.6b": dict(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
                      num_attention_heads=16, num_key_value_heads=16, head_dim=128,
                      max_position_embeddings=65536, rope_theta=1000000.0, total_ut_steps=4,
                      torch_dtype="bfloat16"),
    # A CPU-sized stand-in with the same structure (for the documented CPU command and tests).
    "ouro-tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                      max_position_embeddings=4096, rope_theta=10000.0, total_ut_steps=4,
                      torch_dtype="float32"),
}

_TOKENIZER_VOCAB = 320


def random_weights(cfg: OuroConfig, *, seed: int, gate_bias: float, dtype: torch.dtype,
                   device: torch.device | str) -> dict[str, torch.Tensor]:
    """Random tensors for every expected key, drawn on ``device`` (fast on a GPU).

    Linear weights ~ N(0, (0.5 / sqrt(fan_in))^2) (embeddings 4x), norm weights ~ U(0.9, 1.1), the
    gate bias ``gate_bias`` + small noise: activations stay O(1) through every loop.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for key, shape in ouro_expected_weights(cfg).items():
        if key.endswith("layernorm.weight") or key.endswith("layernorm_2.weight") or key == "model.norm.weight":
            t = 1.0 + 0.2 * (torch.rand(shape, generator=gen, device=device) - 0.5)
        elif key == "model.early_exit_gate.bias":
            t = torch.full(shape, gate_bias, device=device) + 0.1 * torch.randn(shape, generator=gen, device=device)
        else:
            scale = 0.5 / shape[-1] ** 0.5 * (4.0 if "embed" in key else 1.0)
            t = torch.randn(shape, generator=gen, device=device) * scale
        out[key] = t.to(dtype).contiguous()
    return out


def write_random_checkpoint(path: str | Path, name: str, *, seed: int = 0, gate_bias: float = 0.0,
                            device: torch.device | str = "cpu", **overrides) -> Path:
    """Write the named configuration with random weights into ``path``; return ``path``."""
    if name not in NAMED_CONFIGS:
        raise ValueError(f"unknown model config {name!r}; choose one of {', '.join(NAMED_CONFIGS)} "
                         "or pass a checkpoint directory")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    raw = tiny_config(**{**NAMED_CONFIGS[name], **overrides})
    raw["rlt_benchmark_note"] = (f"{name} shapes with random weights (seed {seed}): same bytes and FLOPs "
                                 "as the real model, no text quality")
    cfg = OuroConfig.from_dict(raw)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[raw["torch_dtype"]]
    weights = random_weights(cfg, seed=seed, gate_bias=gate_bias, dtype=dtype, device=device)
    save_file({k: v.cpu() for k, v in weights.items()}, str(root / "model.safetensors"), metadata={"format": "pt"})
    del weights
    (root / "config.json").write_text(json.dumps(raw, indent=1))
    tok = build_tokenizer(min(_TOKENIZER_VOCAB, cfg.vocab_size))
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "model_max_length": raw["max_position_embeddings"], "chat_template": CHATML_TEMPLATE,
        "tokenizer_class": "GPT2Tokenizer",
    }, indent=1))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    return root
