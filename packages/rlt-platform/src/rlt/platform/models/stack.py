"""What the whole-stack looped models (Ouro, Nanbeige) share: config fields and the runtime base.

Both apply one decoder stack with Llama weight names once per loop (models.md §1, §3): embedding
prelude, q/k/v and gate/up projections fused at load time, split-half RoPE with θ from config,
GQA or MHA, no projection biases, an LM-head coda. A family module supplies the per-layer residual
math (``recurrent``), its norms and its exit head; this module owns the common parts, so a fix to
the attention call or the config checks lands in both.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F

from rlt.attention import AttentionBackend, AttentionMetadata, KVCache
from rlt.attention.backend import forward_with_new_kv
from rlt.platform.errors import CheckpointError
from rlt.platform.models.base import LoopedModel, ModelShape, no_exit_gate
from rlt.platform.models.fused_linear import linear_rope_kv, linear_split_k
from rlt.platform.models.fused_ops import SplitSum
from rlt.platform.models.layers import rope_cos_sin, rope_inv_freq


class ConfigReader:
    """Reads ``config.json`` fields of one model type, with errors that name the field."""

    def __init__(self, raw: dict[str, Any], model_type: str) -> None:
        self.raw, self.model_type = raw, model_type

    def need(self, key: str) -> Any:
        if key not in self.raw or self.raw[key] is None:
            raise CheckpointError(f"config.json is missing required field {key!r} for model_type {self.model_type!r}")
        return self.raw[key]

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key)
        return default if value is None else value

    def positive(self, key: str, value: int) -> int:
        if value < 1:
            raise CheckpointError(f"config.json field {key!r} must be >= 1 for model_type {self.model_type!r}, got {value}")
        return value

    def rope_theta(self, family: str, default: float) -> float:
        """θ of the default (unscaled) RoPE; transformers < 5 writes ``rope_theta`` (+ ``rope_scaling``),
        transformers 5 ``rope_parameters = {"rope_type", "rope_theta"}``."""
        rope_params = self.raw.get("rope_parameters") or {}
        for name, scaling in (("rope_scaling", self.raw.get("rope_scaling") or {}), ("rope_parameters", rope_params)):
            if not isinstance(scaling, dict):
                raise CheckpointError(f"{name} must be an object or null, got {scaling!r}")
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind != "default":
                raise CheckpointError(f"RoPE type {kind!r} is not supported for {family} (only the default, unscaled RoPE)")
        return float(next((t for t in (self.raw.get("rope_theta"), rope_params.get("rope_theta")) if t is not None), default))

    def refuse(self, family: str, keys: tuple[str, ...], why: str) -> None:
        """Refuse a config that turns on any of ``keys`` (features rlt does not implement)."""
        on = [k for k in keys if self.raw.get(k)]
        if on:
            raise CheckpointError(f"{', '.join(on)} {'is' if len(on) == 1 else 'are'} set in config.json, but {why} "
                                  f"is not supported for {family}; rlt serves the released {family} configuration")


@attrs.frozen(kw_only=True)
class StackConfig:
    """The config fields every whole-stack family reads (a family subclass adds its loop fields)."""

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
    tie_word_embeddings: bool
    torch_dtype: str | None
    eos_token_id: Any = None
    bos_token_id: Any = None

    @staticmethod
    def common(r: ConfigReader, family: str, *, max_positions: int, rope_theta: float, eps: float) -> dict[str, Any]:
        """The shared fields read from ``r`` (defaults: the family's release values)."""
        return dict(
            vocab_size=int(r.need("vocab_size")),
            intermediate_size=int(r.need("intermediate_size")),
            num_hidden_layers=r.positive("num_hidden_layers", int(r.need("num_hidden_layers"))),
            max_position_embeddings=int(r.get("max_position_embeddings", max_positions)),
            rope_theta=r.rope_theta(family, rope_theta),
            rms_norm_eps=float(r.get("rms_norm_eps", eps)),
            tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
            torch_dtype=r.raw.get("dtype") or r.raw.get("torch_dtype"),
            eos_token_id=r.raw.get("eos_token_id"),
            bos_token_id=r.raw.get("bos_token_id"),
            **attention_fields(r),
        )


def attention_fields(r: ConfigReader) -> dict[str, int]:
    """Heads, KV heads and head_dim of a Llama-style config, checked (GQA divisibility, even head_dim)."""
    heads = int(r.need("num_attention_heads"))
    hidden = int(r.need("hidden_size"))
    kv_heads = int(r.get("num_key_value_heads", heads))
    head_dim = int(r.get("head_dim", hidden // heads))
    if heads % kv_heads:
        raise CheckpointError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    if head_dim % 2:
        raise CheckpointError(f"head_dim must be even for RoPE, got {head_dim}")
    return dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)


def llama_layer_weights(cfg: Any, norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm"),
                        top: dict[str, tuple[int, ...]] | None = None) -> dict[str, tuple[int, ...]]:
    """Weight names and shapes of the stack: embedding, final norm, ``top`` extras, optional head, then
    the Llama layers with the norm weights ``norms`` (the order is the tiny writer's draw order)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    qd, kvd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    shapes.update(top or {})
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
        })
        shapes.update({p + n + ".weight": (h,) for n in norms})
    return shapes


def tied_head_optional(cfg: Any) -> dict[str, tuple[int, ...]]:
    """A tied checkpoint may still store ``lm_head.weight`` (the embedding is used, as in HF)."""
    return {"lm_head.weight": (cfg.vocab_size, cfg.hidden_size)} if cfg.tie_word_embeddings else {}


@attrs.frozen(eq=False)
class StackLayer:
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    #: norm weights by their checkpoint name (``input_layernorm``, ``post_attention_layernorm``, ...)
    norms: dict[str, torch.Tensor]


class StackModel(LoopedModel):
    """Runtime base of a whole-stack looped model: fused projections, paged KV via a backend."""

    def __init__(self, cfg: Any, weights: dict[str, torch.Tensor], *, num_loops: int, norm_names: tuple[str, ...]) -> None:
        super().__init__()
        self.cfg = cfg
        self.shape = ModelShape(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            num_loops=num_loops,
            max_position_embeddings=cfg.max_position_embeddings,
        )
        w = weights
        self.embed = w["model.embed_tokens.weight"]
        self.anchor = self.embed
        self.norm = w["model.norm.weight"]
        self.lm_head = w["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        self.layers = []
        for l in range(cfg.num_hidden_layers):
            p = f"model.layers.{l}."
            self.layers.append(StackLayer(
                qkv=torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], 0).contiguous(),
                o=w[p + "self_attn.o_proj.weight"],
                gate_up=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]], 0).contiguous(),
                down=w[p + "mlp.down_proj.weight"],
                norms={n: w[p + n + ".weight"] for n in norm_names},
            ))
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, device=self.embed.device)
        self.scale = cfg.head_dim ** -0.5

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq, self.embed.dtype)

    def prelude(self, token_ids: torch.Tensor, *_boundary: Any) -> torch.Tensor:
        return F.embedding(token_ids, self.embed)

    def attend(self, idx: int, layer: StackLayer, a: torch.Tensor, rope, kv: KVCache, attention: AttentionBackend,
               meta: AttentionMetadata, split_k: bool = False) -> torch.Tensor | SplitSum:
        """Attention sub-block of layer ``idx`` on its normalised input ``a``: o_proj(attn(...)); with
        ``split_k`` the o_proj may come back as split-K pieces for a consumer that reduces them
        (``fused_ops.add_norm_norm``)."""
        cfg = self.cfg
        cos, sin = rope
        # Decode-sized batches: one kernel projects, rotates and (for flat-slot backends) stores K/V.
        store = (kv.k[idx], kv.v[idx], meta.slot_mapping) if attention.spec.flat_slot_kv_write else None
        q, k, v, stored = linear_rope_kv(a, layer.qkv, cos, sin, cfg.num_attention_heads, cfg.num_key_value_heads,
                                         cfg.head_dim, store)
        if not stored:
            attention.write_kv(kv, idx, k, v, meta)
        # a backend that can read fresh prompt rows' keys densely gets the K/V just stored (AttentionBackend.takes_new_kv)
        out = forward_with_new_kv(attention, q, kv, idx, meta, self.scale, (k, v))
        return (linear_split_k if split_k else F.linear)(out, layer.o)

    def exit_logit(self, hidden: torch.Tensor) -> torch.Tensor:
        """No gate (a family with one overrides this): the exit probability never accumulates."""
        return no_exit_gate(hidden)

    def coda(self, hidden: torch.Tensor, *_boundary: Any) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()
