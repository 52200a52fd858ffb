"""Benchmark models: named real Ouro configurations with random weights, written on the fly.

``write_random_checkpoint(path, "ouro-1.4b")`` writes a Hugging Face layout checkpoint (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json) with the real shapes of the named model
(Ouro-1.4B / 2.6B, Nanbeige4.2-3B, Huginn-0125 at 32 or 4 recurrences; vocab included) and random weights, so a benchmark on it moves the same bytes and does the
same FLOPs as the real model. Random weights keep shapes and costs, not text quality: the text it
generates is noise, and adaptive-depth exit statistics depend on the gate bias chosen here, not
on anything learned.

The tokenizer is the small byte-level BPE of ``rlt.platform.checkpoint.tiny`` (a few hundred
tokens); the engine only needs tokenizer vocab <= model vocab. Benchmarks feed token ids, so the
tokenizer only detokenizes.

:func:`bench_shape` maps any family's config onto the names the harness and the roofline use.
This module owns nothing of the engine: it writes files and returns their directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

import attrs

from rlt.platform.checkpoint.tiny import CHATML_TEMPLATE, build_tokenizer, tiny_config
from rlt.platform.models import MODEL_FAMILIES

#: Real configurations (models.md §1.1, §2.1, §3.1): the family (``model_type``) and the fields
#: that differ from that family's tiny_config defaults.
NAMED_CONFIGS: dict[str, tuple[str, dict]] = {
    "ouro-1.4b": ("ouro", dict(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                               num_attention_heads=16, num_key_value_heads=16, head_dim=128,
                               max_position_embeddings=65536, rope_theta=1000000.0, total_ut_steps=4,
                               torch_dtype="bfloat16")),
    "ouro-2.6b": ("ouro", dict(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
                               num_attention_heads=16, num_key_value_heads=16, head_dim=128,
                               max_position_embeddings=65536, rope_theta=1000000.0, total_ut_steps=4,
                               torch_dtype="bfloat16")),
    "nanbeige4.2-3b": ("nanbeige", dict(vocab_size=166144, hidden_size=3072, intermediate_size=10752,
                                        num_hidden_layers=22, num_attention_heads=48, num_key_value_heads=8,
                                        head_dim=128, max_position_embeddings=262144, rope_theta=70000000.0,
                                        rms_norm_eps=1e-5, num_loops=2, torch_dtype="bfloat16",
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Huginn-0125 with its default 32 recurrences, and with 4 (``mean_recurrence`` sets the default).
    "huginn-0125": ("huginn_raven", dict(_HUGINN := dict(
        n_embd=5280, n_heads=55, num_key_value_heads=55, head_dim=96, n_layers=8, n_layers_in_prelude=2,
        n_layers_in_recurrent_block=4, n_layers_in_coda=2, intermediate_size=17920, vocab_size=65536,
        padded_vocab_size=65536, padding_multiple=4096, block_size=4096, rope_base=50000, norm_eps=1e-6,
        # the release stores fp32; bf16 here halves the checkpoint written per run (rlt serves it
        # in bf16 either way, and only shapes matter for random weights)
        mean_recurrence=32, mean_backprop_depth=8, torch_dtype="bfloat16",
        init_values={"embed_scale": 72.6636084983398, "std": 0.008703882797784892,
                     "embedding": 0.008703882797784892}))),
    "huginn-0125-r4": ("huginn_raven", dict(_HUGINN, mean_recurrence=4)),
    # CPU-sized stand-ins with the same structure (for the documented CPU commands and tests).
    "ouro-tiny": ("ouro", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                               max_position_embeddings=4096, rope_theta=10000.0, total_ut_steps=4,
                               torch_dtype="float32")),
    "nanbeige-tiny": ("nanbeige", dict(vocab_size=512, max_position_embeddings=4096)),
    "huginn-tiny": ("huginn_raven", dict(vocab_size=512, padded_vocab_size=512, block_size=4096)),
}

_TOKENIZER_VOCAB = 320


@attrs.frozen
class BenchShape:
    """One family's shapes under the names the harness uses (the looped stack as "layers").

    ``boundary_layers`` run once per token outside the loop (Huginn's prelude + coda blocks) and
    ``extra_params_per_loop`` are loop weights outside the layers (Huginn's injection adapter)."""

    family: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    total_ut_steps: int
    torch_dtype: str | None
    boundary_layers: int = 0
    extra_params_per_loop: int = 0


def bench_shape(family: str, cfg) -> BenchShape:
    """The :class:`BenchShape` of a parsed config of ``family`` (a ``model_type``)."""
    if family == "huginn_raven":
        e = cfg.n_embd
        return BenchShape(family, cfg.n_layers_in_recurrent_block, e, cfg.intermediate_size, cfg.n_heads,
                          getattr(cfg, "num_key_value_heads", cfg.n_heads), cfg.head_dim, cfg.vocab_size,
                          cfg.mean_recurrence, cfg.torch_dtype,
                          boundary_layers=cfg.n_layers_in_prelude + cfg.n_layers_in_coda,
                          extra_params_per_loop=2 * e * e)
    loops = cfg.total_ut_steps if family == "ouro" else cfg.num_loops
    return BenchShape(family, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size,
                      cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size, loops,
                      cfg.torch_dtype)


def named_shape(name: str) -> BenchShape:
    """The :class:`BenchShape` of a :data:`NAMED_CONFIGS` entry (no weights written)."""
    family, fields = NAMED_CONFIGS[name]
    return bench_shape(family, MODEL_FAMILIES[family].parse_config(tiny_config(family, **fields)))


def random_weights(family: str, cfg, *, seed: int, gate_bias: float, dtype: torch.dtype,
                   device: torch.device | str) -> dict[str, torch.Tensor]:
    """Random tensors for every expected key of ``family``, drawn on ``device`` (fast on a GPU).

    Linear weights ~ N(0, (0.5 / sqrt(fan_in))^2) (embeddings 4x), norm weights ~ U(0.9, 1.1), Ouro's
    gate bias ``gate_bias`` + small noise, Huginn's q/k bias small: activations stay O(1) through
    every loop.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for key, shape in MODEL_FAMILIES[family].expected_weights(cfg).items():
        leaf = key.rsplit(".", 2)[-2] if key.endswith(".weight") else key.rsplit(".", 1)[-1]
        if "norm" in leaf or leaf == "ln_f":
            t = 1.0 + 0.2 * (torch.rand(shape, generator=gen, device=device) - 0.5)
        elif key == "model.early_exit_gate.bias":
            t = torch.full(shape, gate_bias, device=device) + 0.1 * torch.randn(shape, generator=gen, device=device)
        elif leaf == "qk_bias":
            t = 0.1 * torch.randn(shape, generator=gen, device=device)
        else:
            scale = 0.5 / shape[-1] ** 0.5 * (4.0 if ("embed" in key or "wte" in key) else 1.0)
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
    family, fields = NAMED_CONFIGS[name]
    raw = tiny_config(family, **{**fields, **overrides})
    raw.pop("auto_map", None)
    raw["rlt_benchmark_note"] = (f"{name} shapes with random weights (seed {seed}): same bytes and FLOPs "
                                 "as the real model, no text quality")
    cfg = MODEL_FAMILIES[family].parse_config(raw)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[raw["torch_dtype"]]
    weights = random_weights(family, cfg, seed=seed, gate_bias=gate_bias, dtype=dtype, device=device)
    save_file({k: v.cpu() for k, v in weights.items()}, str(root / "model.safetensors"), metadata={"format": "pt"})
    del weights
    (root / "config.json").write_text(json.dumps(raw, indent=1))
    tok = build_tokenizer(min(_TOKENIZER_VOCAB, cfg.vocab_size))
    tok.save(str(root / "tokenizer.json"))
    max_len = raw.get("max_position_embeddings", raw.get("block_size"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "model_max_length": max_len, "chat_template": CHATML_TEMPLATE,
        "tokenizer_class": "GPT2Tokenizer",
    }, indent=1))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    return root
