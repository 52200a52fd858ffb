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
from rlt.platform.models.base import LoopedModel, ModelFamily, ModelShape
from rlt.platform.models.fused_ops import add_norm_norm, rope_qk_, silu_mul
from rlt.platform.models.layers import rms_norm, rope_cos_sin, rope_inv_freq


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
        def need(key: str):
            if key not in raw or raw[key] is None:
                raise CheckpointError(f"config.json is missing required field {key!r} for model_type 'ouro'")
            return raw[key]

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = raw.get("head_dim") or hidden // heads
        # RoPE: transformers < 5 writes ``rope_theta`` (+ ``rope_scaling``), transformers 5 writes
        # ``rope_parameters = {"rope_type", "rope_theta"}``; only the default (unscaled) type exists
        # for Ouro.
        rope_params = raw.get("rope_parameters") or {}
        for name, scaling in (("rope_scaling", raw.get("rope_scaling") or {}), ("rope_parameters", rope_params)):
            if not isinstance(scaling, dict):
                raise CheckpointError(f"{name} must be an object or null, got {scaling!r}")
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind != "default":
                raise CheckpointError(f"RoPE type {kind!r} is not supported for Ouro (only the default, unscaled RoPE)")
        rope_theta = next((t for t in (raw.get("rope_theta"), rope_params.get("rope_theta")) if t is not None), 1e6)
        sliding = raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or ())
        if sliding:
            raise CheckpointError("sliding-window attention layers are not supported for Ouro "
                                  "(use_sliding_window / layer_types); every Ouro release uses full attention")
        cfg = cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(raw.get("max_position_embeddings", 65536)),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            total_ut_steps=int(raw.get("total_ut_steps", 4)),
            early_exit_threshold=float(raw.get("early_exit_threshold", 1.0)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            eos_token_id=raw.get("eos_token_id"),
            bos_token_id=raw.get("bos_token_id"),
        )
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({cfg.num_key_value_heads})"
            )
        if cfg.head_dim % 2:
            raise CheckpointError(f"head_dim must be even for RoPE, got {cfg.head_dim}")
        if cfg.total_ut_steps < 1:
            raise CheckpointError(f"total_ut_steps must be >= 1, got {cfg.total_ut_steps}")
        return cfg


def ouro_expected_weights(cfg: OuroConfig) -> dict[str, tuple[int, ...]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    qd, kvd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
        "model.early_exit_gate.weight": (1, h),
        "model.early_exit_gate.bias": (1,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        shapes.update({
            p + "self_attn.q_proj.weight": (qd, h),
            p + "self_attn.k_proj.weight": (kvd, h),
            p + "self_attn.v_proj.weight": (kvd, h),
            p + "self_attn.o_proj.weight": (h, qd),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "input_layernorm_2.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "post_attention_layernorm_2.weight": (h,),
        })
    return shapes


@attrs.frozen(eq=False)
class _Layer:
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    ln_in: torch.Tensor
    ln_in2: torch.Tensor
    ln_post: torch.Tensor
    ln_post2: torch.Tensor


class OuroModel(LoopedModel):
    """Runtime Ouro: fused projections, paged KV through an attention backend."""

    def __init__(self, cfg: OuroConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.cfg = cfg
        self.shape = ModelShape(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            num_loops=cfg.total_ut_steps,
            max_position_embeddings=cfg.max_position_embeddings,
        )
        w = weights
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.gate_w = w["model.early_exit_gate.weight"].float()
        self.gate_b = w["model.early_exit_gate.bias"].float()
        self.lm_head = w["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        self.layers = []
        for l in range(cfg.num_hidden_layers):
            p = f"model.layers.{l}."
            self.layers.append(_Layer(
                qkv=torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], 0).contiguous(),
                o=w[p + "self_attn.o_proj.weight"],
                gate_up=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]], 0).contiguous(),
                down=w[p + "mlp.down_proj.weight"],
                ln_in=w[p + "input_layernorm.weight"],
                ln_in2=w[p + "input_layernorm_2.weight"],
                ln_post=w[p + "post_attention_layernorm.weight"],
                ln_post2=w[p + "post_attention_layernorm_2.weight"],
            ))
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, device=self.embed.device)
        self.scale = cfg.head_dim ** -0.5
        self._q = cfg.num_attention_heads * cfg.head_dim
        self._kv = cfg.num_key_value_heads * cfg.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq, self.embed.dtype)

    def prelude(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embed)

    def recurrent(self, hidden, rope, kv: KVCache, attention: AttentionBackend, meta: AttentionMetadata):
        cfg = self.cfg
        cos, sin = rope
        eps = cfg.rms_norm_eps
        h = hidden
        a = rms_norm(h, self.layers[0].ln_in, eps)
        last = len(self.layers) - 1
        for idx, layer in enumerate(self.layers):
            q, k, v = rope_qk_(F.linear(a, layer.qkv), cos, sin, cfg.num_attention_heads,
                               cfg.num_key_value_heads, cfg.head_dim)
            attention.write_kv(kv, idx, k, v, meta)
            o = attention.forward(q, kv, idx, meta, self.scale)
            # h += RMS_in2(o_proj(o)); m = RMS_post(h)   (one fused pass on GPU)
            h, m = add_norm_norm(h, F.linear(o, layer.o), layer.ln_in2, layer.ln_post, eps)
            act = silu_mul(F.linear(m, layer.gate_up))
            # h += RMS_post2(down(...)); then the next layer's RMS_in(h), or the end-of-loop norm
            nxt = self.norm if idx == last else self.layers[idx + 1].ln_in
            h, a = add_norm_norm(h, F.linear(act, layer.down), layer.ln_post2, nxt, eps)
        return a

    def exit_logit(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden.float() @ self.gate_w.T + self.gate_b).squeeze(-1)

    def coda(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()


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
)
