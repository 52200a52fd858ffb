"""Ouro (ByteDance Ouro-1.4B / 2.6B and the Thinking variants): config, weights, runtime model.

Architecture (models.md §1): the whole L-layer stack is applied ``total_ut_steps`` times. Each layer
is a sandwich block: ``h += RMS_in2(Attn(RMS_in(h)))``, ``h += RMS_post2(MLP(RMS_post(h)))``. After
every loop the shared final norm produces the next loop's input, the exit-gate input
(``early_exit_gate``, with bias) and the LM-head input (untied ``lm_head``). Split-half RoPE with
θ from config, GQA or MHA, no projection biases.

The runtime model fuses q/k/v and gate/up projections at load time and runs one loop per
``recurrent`` call over a packed batch of rows at mixed depths (their depths only matter to the
attention backend, through the metadata). The oracle lives in ``ouro_reference``.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F

from rlt.attention import AttentionBackend, AttentionMetadata, KVCache
from rlt.platform.errors import CheckpointError
from rlt.platform.models.base import ModelFamily
from rlt.platform.models.fused_ops import add_norm_norm, silu_mul
from rlt.platform.models.layers import rms_norm
from rlt.platform.models.stack import ConfigReader, StackModel, attention_fields, llama_layer_weights, tied_head_optional


@attrs.frozen
class OuroConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    total_ut_steps: int
    early_exit_threshold: float
    tie_word_embeddings: bool
    torch_dtype: str | None
    eos_token_id: Any = None
    bos_token_id: Any = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "OuroConfig":
        r = ConfigReader(raw, "ouro")
        attn = attention_fields(r)
        rope_theta = r.rope_theta("Ouro", 1e6)
        sliding = raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or ())
        if sliding:
            raise CheckpointError("sliding-window attention layers are not supported for Ouro "
                                  "(use_sliding_window / layer_types); every Ouro release uses full attention")
        cfg = cls(
            vocab_size=int(r.need("vocab_size")),
            intermediate_size=int(r.need("intermediate_size")),
            num_hidden_layers=int(r.need("num_hidden_layers")),
            max_position_embeddings=int(raw.get("max_position_embeddings", 65536)),
            rope_theta=rope_theta,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            total_ut_steps=int(raw.get("total_ut_steps", 4)),
            early_exit_threshold=float(raw.get("early_exit_threshold", 1.0)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            eos_token_id=raw.get("eos_token_id"),
            bos_token_id=raw.get("bos_token_id"),
            **attn,
        )
        if cfg.total_ut_steps < 1:
            raise CheckpointError(f"total_ut_steps must be >= 1, got {cfg.total_ut_steps}")
        return cfg


_SANDWICH_NORMS = ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2")


def ouro_expected_weights(cfg: OuroConfig) -> dict[str, tuple[int, ...]]:
    return llama_layer_weights(cfg, _SANDWICH_NORMS, top={"model.early_exit_gate.weight": (1, cfg.hidden_size),
                                                         "model.early_exit_gate.bias": (1,)})


class OuroModel(StackModel):
    """Runtime Ouro: fused projections, paged KV through an attention backend."""

    def __init__(self, cfg: OuroConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__(cfg, weights, num_loops=cfg.total_ut_steps, norm_names=_SANDWICH_NORMS)
        self.gate_w = weights["model.early_exit_gate.weight"].float()
        self.gate_b = weights["model.early_exit_gate.bias"].float()

    def recurrent(self, hidden, rope, kv: KVCache, attention: AttentionBackend, meta: AttentionMetadata):
        eps = self.cfg.rms_norm_eps
        h = hidden
        a = rms_norm(h, self.layers[0].norms["input_layernorm"], eps)
        last = len(self.layers) - 1
        for idx, layer in enumerate(self.layers):
            n = layer.norms
            o = self.attend(idx, layer, a, rope, kv, attention, meta)
            # h += RMS_in2(o_proj(o)); m = RMS_post(h)   (one fused pass on GPU)
            h, m = add_norm_norm(h, o, n["input_layernorm_2"], n["post_attention_layernorm"], eps)
            act = silu_mul(F.linear(m, layer.gate_up))
            # h += RMS_post2(down(...)); then the next layer's RMS_in(h), or the end-of-loop norm
            nxt = self.norm if idx == last else self.layers[idx + 1].norms["input_layernorm"]
            h, a = add_norm_norm(h, F.linear(act, layer.down), n["post_attention_layernorm_2"], nxt, eps)
        return a

    def exit_logit(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden.float() @ self.gate_w.T + self.gate_b).squeeze(-1)


def _build_reference(cfg: OuroConfig, weights: dict[str, torch.Tensor]):
    from rlt.platform.models.ouro_reference import OuroReference

    return OuroReference(cfg, weights)


OURO = ModelFamily(
    model_type="ouro",
    parse_config=OuroConfig.from_dict,
    expected_weights=ouro_expected_weights,
    build_runtime=OuroModel,
    build_reference=_build_reference,
    default_stop_token_ids=(2, 0),  # <|im_end|>, <|endoftext|> (models.md §1.8)
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
    optional_weights=tied_head_optional,
)
