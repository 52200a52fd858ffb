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

from rlt.attention import AttentionBackend, AttentionMetadata, KVCache
from rlt.platform.errors import CheckpointError
from rlt.platform.models.base import ModelFamily
from rlt.platform.models.fused_linear import linear_silu_mul, linear_split_k
from rlt.platform.models.fused_ops import add_norm_norm
from rlt.platform.models.layers import rms_norm
from rlt.platform.models.stack import ConfigReader, StackConfig, StackModel, llama_layer_weights, tied_head_optional


@attrs.frozen(kw_only=True)
class OuroConfig(StackConfig):
    total_ut_steps: int
    early_exit_threshold: float
    #: ``early_exit_step`` k (read by OuroForCausalLM when in [0, total_ut_steps)): its default
    #: forward feeds the head loop k's state. Loops past k never reach loops <= k of any token, so
    #: that is exactly k + 1 loops: :attr:`default_loops`.
    early_exit_step: int | None = None

    @property
    def default_loops(self) -> int:
        """The checkpoint's depth: ``early_exit_step + 1`` when the config forces an exit step, else
        ``total_ut_steps``."""
        step = self.early_exit_step
        return step + 1 if step is not None and 0 <= step < self.total_ut_steps else self.total_ut_steps

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "OuroConfig":
        # Defaults for omitted fields are OuroConfig's (the Qwen2-derived class of the public code):
        # rope_theta 10000, max_position_embeddings 32768, num_key_value_heads 32 when the key is
        # absent (an explicit null means num_attention_heads). Every release config gives them all.
        if "num_key_value_heads" not in raw:
            raw = {**raw, "num_key_value_heads": 32}
        r = ConfigReader(raw, "ouro")
        common = StackConfig.common(r, "Ouro", max_positions=32768, rope_theta=10000.0, eps=1e-6)
        act = r.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"hidden_act {act!r} is not supported for Ouro (only 'silu', as released)")
        if "sliding_attention" in _layer_types(raw, common["num_hidden_layers"]):
            raise CheckpointError("sliding-window attention layers are not supported for Ouro "
                                  "(use_sliding_window / layer_types); every Ouro release uses full attention")
        step = r.get("early_exit_step")
        return cls(total_ut_steps=r.positive("total_ut_steps", int(r.get("total_ut_steps", 4))),
                   early_exit_threshold=float(r.get("early_exit_threshold", 1.0)),
                   early_exit_step=None if step is None else int(step), **common)


def _layer_types(raw: dict[str, Any], num_layers: int) -> list[str]:
    """OuroConfig's layer types: as given, else sliding from ``max_window_layers`` (28) on when
    ``use_sliding_window`` is set and ``sliding_window`` (4096) is not null."""
    if raw.get("layer_types"):
        return list(raw["layer_types"])
    window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window") else None
    first = raw.get("max_window_layers", 28)
    return ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(num_layers)]


_SANDWICH_NORMS = ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2")


def ouro_expected_weights(cfg: OuroConfig) -> dict[str, tuple[int, ...]]:
    return llama_layer_weights(cfg, _SANDWICH_NORMS, top={"model.early_exit_gate.weight": (1, cfg.hidden_size),
                                                         "model.early_exit_gate.bias": (1,)})


class OuroModel(StackModel):
    """Runtime Ouro: fused projections, paged KV through an attention backend."""

    def __init__(self, cfg: OuroConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__(cfg, weights, num_loops=cfg.default_loops, norm_names=_SANDWICH_NORMS)
        self.gate_w = weights["model.early_exit_gate.weight"].float()
        self.gate_b = weights["model.early_exit_gate.bias"].float()

    def recurrent(self, hidden, rope, kv: KVCache, attention: AttentionBackend, meta: AttentionMetadata):
        eps = self.cfg.rms_norm_eps
        h = hidden
        a = rms_norm(h, self.layers[0].norms["input_layernorm"], eps)
        last = len(self.layers) - 1
        for idx, layer in enumerate(self.layers):
            n = layer.norms
            o = self.attend(idx, layer, a, rope, kv, attention, meta, split_k=True)
            # h += RMS_in2(o_proj(o)); m = RMS_post(h)   (one fused pass on GPU; for decode-sized batches it
            # also sums o_proj's split-K pieces, fused_linear.linear_split_k)
            h, m = add_norm_norm(h, o, n["input_layernorm_2"], n["post_attention_layernorm"], eps)
            act = linear_silu_mul(m, layer.gate_up)
            # h += RMS_post2(down(...)); then the next layer's RMS_in(h), or the end-of-loop norm
            nxt = self.norm if idx == last else self.layers[idx + 1].norms["input_layernorm"]
            h, a = add_norm_norm(h, linear_split_k(act, layer.down), n["post_attention_layernorm_2"], nxt, eps)
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
