"""Write tiny checkpoints of every family in exactly the Hugging Face layout (tests, demo models).

Random weights (every tensor randomised, norm weights, the gate bias and Huginn's q/k bias
included, so defaults of ones or zeros cannot hide a bug), a small byte-level BPE tokenizer trained
on a built-in corpus with the family's special tokens first, and the family's chat template:

* ``ouro``: ChatML; ``thinking=True`` gives the Thinking template (``enable_thinking`` appends
  ``<think>\n``). Ids 0/1/2 are ``<|endoftext|>`` / ``<|im_start|>`` / ``<|im_end|>`` as in Ouro.
* ``nanbeige``: ChatML in the Qwen3 style (``enable_thinking=False`` appends an empty think
  block); ``eos_token_id`` in config.json is ``<|im_end|>``'s id, as on the release.
* ``huginn_raven``: the release template (bos once, ``<|begin_header|>role<|end_header|>\n\n``,
  role ``assistant`` rendered as ``Huginn``, ``{% generation %}`` tags); specials
  ``<|begin_text|>``, ``<|end_text|>``, ``<|begin_header|>``, ``<|end_header|>``, ``<|end_turn|>``,
  ``<|pad|>`` (ids 0..5 here, 65504..65509 on the release). ``store_extras=True`` also writes the
  duplicate ``lm_head.weight`` and the ``freqs_cis`` buffer, as the released files do.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from rlt.platform.models import MODEL_FAMILIES
from rlt.platform.models.layers import rope_inv_freq, rope_pair_cos_sin

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HUGINN_SPECIAL_TOKENS = ["<|begin_text|>", "<|end_text|>", "<|begin_header|>", "<|end_header|>", "<|end_turn|>",
                         "<|pad|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)

NANBEIGE_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)

#: The chat template of tomg-group-umd/huginn-0125 (recurrent-pretraining's converter).
HUGINN_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set start_content = '<|begin_header|>' %}"
    "{% set end_content = message['content'] | trim  + '<|end_turn|>' %}{% if loop.index0 == 0 %}"
    "{% set start_content = bos_token + start_content %}{% endif %}"
    "{% if message['role'] == 'Huginn' or message['role'] == 'assistant' %}"
    "{% set start_content = start_content + 'Huginn<|end_header|>\\n\\n' %}{{ start_content }}"
    "{% generation %}{{ end_content }}{% endgeneration %}{% else %}"
    "{% set start_content = start_content + message['role'] + '<|end_header|>\\n\\n' %}{{ start_content }}"
    "{{ end_content }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|begin_header|>Huginn<|end_header|>\\n\\n' }}{% else %}{{ '<|end_text|>' }}{% endif %}"
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


def build_tokenizer(vocab_size: int, special_tokens: list[str] = SPECIAL_TOKENS) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok


def tiny_config(family: str = "ouro", **overrides) -> dict:
    """A tiny config.json of ``family`` (models.md §8), with ``overrides`` applied."""
    cfg = json.loads(json.dumps(_TINY_CONFIGS[family]))  # a deep copy
    cfg.update(overrides)
    return cfg


#: Fields the tiny Llama-named stacks (Ouro, Nanbeige) share.
_TINY_STACK = {
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
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

_TINY_CONFIGS: dict[str, dict] = {
    "ouro": {
        "architectures": ["OuroForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig",
                     "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
        "model_type": "ouro",
        **_TINY_STACK,
        "rms_norm_eps": 1e-6,
        "total_ut_steps": 4,
        "early_exit_threshold": 1.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "use_sliding_window": False,
    },
    "nanbeige": {
        "architectures": ["NanbeigeForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_nanbeige.NanbeigeConfig",
                     "AutoModelForCausalLM": "modeling_nanbeige.NanbeigeForCausalLM"},
        "model_type": "nanbeige",
        **_TINY_STACK,
        "head_dim": 16,  # q dim 64 != hidden 32, as on the release (6144 != 3072)
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "num_loops": 2,
        "loop_loss_weights": [],
        "skip_loop_final_norm": False,
        "pretraining_tp": 1,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "huginn_raven": {
        "architectures": ["RavenForCausalLM"],
        "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig",
                     "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"},
        "model_type": "huginn_raven",
        "n_embd": 32,
        "n_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "n_layers": 4,
        "n_layers_in_prelude": 1,
        "n_layers_in_recurrent_block": 2,
        "n_layers_in_coda": 1,
        "intermediate_size": 64,
        "vocab_size": 320,
        "padded_vocab_size": 320,
        "padding_multiple": 64,
        "block_size": 64,
        "rope_base": 10000,
        "norm_eps": 1e-6,
        "norm_class_name": "RMSNorm_llama",
        "block_class_name": "SandwichBlock",
        "mlp_class_name": "GatedMLP",
        "nonlin_name": "SiLU",
        "qk_bias": True,
        "bias": False,
        "tie_embeddings": True,
        "injection_type": "linear",
        "state_init": "like-init",
        "mean_recurrence": 3,
        "mean_backprop_depth": 2,
        "init_values": {"embed_scale": 32 ** 0.5, "std": (2 / (5 * 32)) ** 0.5, "embedding": (2 / (5 * 32)) ** 0.5},
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 5,
        "torch_dtype": "float32",
    },
}


def _random_tensor(key: str, shape: tuple[int, ...], gen: torch.Generator, *, gate_bias: float,
                   weight_scale: float) -> torch.Tensor:
    leaf = key.rsplit(".", 2)[-2] if key.endswith(".weight") else key.rsplit(".", 1)[-1]
    if "norm" in leaf or leaf == "ln_f":
        return 1.0 + 0.2 * (torch.rand(shape, generator=gen) - 0.5)
    if key == "model.early_exit_gate.bias":
        return torch.full(shape, gate_bias) + 0.1 * torch.randn(shape, generator=gen)
    if leaf == "qk_bias":
        return 0.3 * torch.randn(shape, generator=gen)
    fan_in = shape[-1]
    return torch.randn(shape, generator=gen) * (weight_scale / fan_in ** 0.5) * (4.0 if "embed" in key else 1.0)


def _save_weights(root: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    keys = sorted(tensors)
    if shards <= 1:
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    per = -(-len(keys) // shards)
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[s * per:(s + 1) * per]}
        save_file(part, str(root / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))


def _tokenizer_files(family: str, raw: dict, thinking: bool) -> tuple[list[str], dict, dict]:
    """(special tokens, tokenizer_config.json, generation_config.json) of a tiny ``family`` checkpoint."""
    if family == "huginn_raven":
        specials, (bos, eos, pad), cls, template = HUGINN_SPECIAL_TOKENS, HUGINN_SPECIAL_TOKENS[:2] + ["<|pad|>"], \
            "PreTrainedTokenizerFast", HUGINN_TEMPLATE
        generation = {"bos_token_id": 0, "eos_token_id": [1, 4], "pad_token_id": 5}
    else:
        specials, (pad, bos, eos) = SPECIAL_TOKENS, SPECIAL_TOKENS
        if family == "nanbeige":
            cls, template, generation = "LlamaTokenizerFast", NANBEIGE_TEMPLATE, {"eos_token_id": 2, "bos_token_id": 1}
        else:
            cls, generation = "GPT2Tokenizer", {"eos_token_id": [2, 0], "bos_token_id": 1}
            template = CHATML_TEMPLATE if thinking else CHATML_TEMPLATE.replace(
                "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\\n' }}{% endif %}", "")
    config = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "chat_template": template, "tokenizer_class": cls,
              "model_max_length": raw.get("max_position_embeddings", raw.get("block_size"))}
    return specials, config, generation


def write_tiny_checkpoint(
    path: str | Path,
    *,
    family: str = "ouro",
    seed: int = 0,
    gate_bias: float = 0.0,
    weight_scale: float = 0.5,
    shards: int = 1,
    thinking: bool = False,
    store_extras: bool = False,
    dtype_key: str = "torch_dtype",
    auto_map: bool = True,
    **config_overrides,
) -> Path:
    """Write a random tiny checkpoint of ``family`` (a ``model_type``) into ``path`` and return it.

    ``auto_map`` keeps the Hugging Face ``auto_map`` of the real checkpoints (which rlt ignores);
    without it a transformers client loads the config and tokenizer without asking to run code.
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    raw = tiny_config(family, **config_overrides)
    if not auto_map:
        raw.pop("auto_map", None)
    if dtype_key != "torch_dtype":
        raw[dtype_key] = raw.pop("torch_dtype")
    specials, tok_config, gen_config = _tokenizer_files(family, raw, thinking)
    tok = build_tokenizer(raw["vocab_size"], specials)
    if tok.get_vocab_size() != raw["vocab_size"]:
        raise ValueError(f"tokenizer vocab {tok.get_vocab_size()} != vocab_size {raw['vocab_size']}")
    fam = MODEL_FAMILIES[family]
    cfg = fam.parse_config(raw)
    gen = torch.Generator().manual_seed(seed)
    tensors = {key: _random_tensor(key, shape, gen, gate_bias=gate_bias, weight_scale=weight_scale).contiguous()
               for key, shape in fam.expected_weights(cfg).items()}
    if family == "huginn_raven" and "transformer.wte.weight" in tensors:
        # std 1/sqrt(E): the input (times embed_scale = sqrt(E)) and the tied-head logits are O(1)
        tensors["transformer.wte.weight"] /= weight_scale
    if store_extras and family == "huginn_raven":
        if cfg.tie_embeddings:
            tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
        cos, sin = rope_pair_cos_sin(torch.arange(cfg.block_size), rope_inv_freq(cfg.head_dim, cfg.rope_base))
        tensors["freqs_cis"] = torch.stack((cos, sin), dim=-1)[None, :, None].contiguous()
    _save_weights(root, tensors, shards)
    (root / "config.json").write_text(json.dumps(raw, indent=1))
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    (root / "generation_config.json").write_text(json.dumps(gen_config))
    if family == "huginn_raven":  # the release ships its modeling code; rlt must never run it
        (root / "raven_modeling_minimal.py").write_text("raise RuntimeError('checkpoint code must never run')\n")
    return root
