"""Write tiny Ouro checkpoints in exactly the Hugging Face layout (tests and the demo model).

Random weights (every tensor randomised, norm weights and the gate bias included, so defaults of
ones or zeros cannot hide a bug), a small byte-level BPE tokenizer trained on a built-in corpus,
and a ChatML chat template with ``enable_thinking`` for Thinking-style checkpoints. Token ids
0/1/2 are ``<|endoftext|>`` / ``<|im_start|>`` / ``<|im_end|>`` as in Ouro.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from rlt.platform.models.ouro import OuroConfig, ouro_expected_weights

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Looped language models apply one shared stack of layers several times per token.",
    "Hello world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159",
    "Continuous depth batching lets rows at different loop depths share one call.",
    "Ouro is a looped language model. Huginn and Nanbeige are too.",
    "the of and to in is it you that he was for on are with as his they be at one have this",
]


def build_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok


def tiny_config(**overrides) -> dict:
    cfg = {
        "architectures": ["OuroForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig",
                     "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
        "model_type": "ouro",
        "vocab_size": 320,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "total_ut_steps": 4,
        "early_exit_threshold": 1.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": "float32",
        "use_sliding_window": False,
    }
    cfg.update(overrides)
    return cfg


def write_tiny_checkpoint(
    path: str | Path,
    *,
    seed: int = 0,
    gate_bias: float = 0.0,
    weight_scale: float = 0.5,
    shards: int = 1,
    thinking: bool = False,
    dtype_key: str = "torch_dtype",
    auto_map: bool = True,
    **config_overrides,
) -> Path:
    """Write a random tiny Ouro checkpoint into ``path`` and return it.

    ``auto_map`` keeps the Hugging Face ``auto_map`` of the real checkpoints (which rlt ignores);
    without it a transformers client loads the config and tokenizer without asking to run code.
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    raw = tiny_config(**config_overrides)
    if not auto_map:
        del raw["auto_map"]
    if dtype_key != "torch_dtype":
        raw[dtype_key] = raw.pop("torch_dtype")
    tok = build_tokenizer(raw["vocab_size"])
    if tok.get_vocab_size() != raw["vocab_size"]:
        raise ValueError(f"tokenizer vocab {tok.get_vocab_size()} != vocab_size {raw['vocab_size']}")
    cfg = OuroConfig.from_dict(raw)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for key, shape in ouro_expected_weights(cfg).items():
        if key.endswith("layernorm.weight") or key.endswith("layernorm_2.weight") or key == "model.norm.weight":
            t = 1.0 + 0.2 * (torch.rand(shape, generator=gen) - 0.5)
        elif key == "model.early_exit_gate.bias":
            t = torch.full(shape, gate_bias) + 0.1 * torch.randn(shape, generator=gen)
        else:
            fan_in = shape[-1]
            t = torch.randn(shape, generator=gen) * (weight_scale / fan_in ** 0.5) * (4.0 if "embed" in key else 1.0)
        tensors[key] = t.contiguous()
    keys = sorted(tensors)
    if shards <= 1:
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        per = -(-len(keys) // shards)
        for s in range(shards):
            name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: tensors[k] for k in keys[s * per:(s + 1) * per]}
            save_file(part, str(root / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in part})
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (root / "config.json").write_text(json.dumps(raw, indent=1))
    tok.save(str(root / "tokenizer.json"))
    template = CHATML_TEMPLATE if thinking else CHATML_TEMPLATE.replace(
        "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\\n' }}{% endif %}", "")
    (root / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": raw["max_position_embeddings"],
        "chat_template": template,
        "tokenizer_class": "GPT2Tokenizer",
    }, indent=1))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    return root
