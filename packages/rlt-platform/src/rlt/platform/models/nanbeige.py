"""Nanbeige (Nanbeige4.2-3B): config, weights, runtime model.

Architecture (models.md §3): the plain Llama pre-norm stack (``h += Attn(RMS_in(h))``,
``h += MLP(RMS_post(h))``), GQA, split-half RoPE with θ from config (7e7 on the release), run
``num_loops`` times (2 on the release); the shared final norm ``model.norm`` is applied after
every loop unless ``skip_loop_final_norm``; untied LM head. No exit gate: fixed depth, each loop
with its own KV plane (slot ``loop * L + layer``). The config's optional research features that
the release leaves off (n-gram embeddings, hyper-connections, LoopSplit, shared loop KV, depth
attention, q/k norms) are refused rather than silently ignored.

When ``skip_loop_final_norm`` is set, the final norm is still applied once, after the last loop —
as the release's ``NanbeigeModel.forward`` does (read in ``modeling_nanbeige.py`` at revision
b82e54bd; models.md's pseudocode omits it). With the flag off, the last loop's norm is that norm.
Omitted config fields take ``NanbeigeConfig``'s defaults (docs/models.md).
The oracle lives in ``nanbeige_reference``.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F

from rlt.attention import AttentionBackend, AttentionMetadata, KVCache
from rlt.platform.errors import CheckpointError
from rlt.platform.models.base import ModelFamily
from rlt.platform.models.fused_linear import linear_silu_mul
from rlt.platform.models.layers import rms_norm
from rlt.platform.models.stack import ConfigReader, StackConfig, StackModel, llama_layer_weights, tied_head_optional

#: Optional features of the official modeling code, all off in the release (models.md §3.1).
_REFUSED = ("emb_neighbor_num", "emb_split_num", "ngram_vocab_size_ratio", "insert_ngram_layer_idx",
            "ngram_insert_all_layers", "enable_hyper_connection", "enable_mhc", "enable_h_res_identity",
            "enable_double_loop_split", "loop_share_kv", "enable_depth_attention", "qk_layernorm")


@attrs.frozen(kw_only=True)
class NanbeigeConfig(StackConfig):
    num_loops: int
    skip_loop_final_norm: bool

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "NanbeigeConfig":
        # Defaults for omitted fields are NanbeigeConfig's (configuration_nanbeige.py of the release):
        # rms_norm_eps 1e-6, rope_theta 10000, num_loops 1, max_position_embeddings 2048, eos 2 when
        # the key is absent. The release config gives every one of them (1e-5, 7e7, 2, 262144, 166101).
        r = ConfigReader(raw, "nanbeige")
        common = StackConfig.common(r, "Nanbeige", max_positions=2048, rope_theta=10000.0, eps=1e-6)
        if "eos_token_id" not in raw:
            common["eos_token_id"] = 2
        r.refuse("Nanbeige", _REFUSED, "an optional research feature of the official code")
        r.refuse("Nanbeige", ("attention_bias", "mlp_bias"), "a projection bias")
        if raw.get("loop_loss_weights"):
            raise CheckpointError("loop_loss_weights is non-empty in config.json: it is a training feature that changes "
                                  "the loop count; set it to [] and give the loop count in num_loops")
        if int(r.get("pretraining_tp", 1)) != 1:
            raise CheckpointError(f"pretraining_tp {raw['pretraining_tp']!r} is not supported for Nanbeige (only 1, as "
                                  "released: sliced projections change the sums)")
        act = r.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"hidden_act {act!r} is not supported for Nanbeige (only 'silu')")
        return cls(num_loops=r.positive("num_loops", int(r.get("num_loops", 1))),
                   skip_loop_final_norm=bool(r.get("skip_loop_final_norm", False)), **common)


def nanbeige_expected_weights(cfg: NanbeigeConfig) -> dict[str, tuple[int, ...]]:
    return llama_layer_weights(cfg)


class NanbeigeModel(StackModel):
    """Runtime Nanbeige: the Llama stack per ``recurrent`` call, fused projections, paged KV."""

    has_exit_gate = False

    def __init__(self, cfg: NanbeigeConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__(cfg, weights, num_loops=cfg.num_loops, norm_names=("input_layernorm", "post_attention_layernorm"))

    def recurrent(self, hidden, rope, kv: KVCache, attention: AttentionBackend, meta: AttentionMetadata):
        eps = self.cfg.rms_norm_eps
        h = hidden
        for idx, layer in enumerate(self.layers):
            n = layer.norms
            h = h + self.attend(idx, layer, rms_norm(h, n["input_layernorm"], eps), rope, kv, attention, meta)
            act = linear_silu_mul(rms_norm(h, n["post_attention_layernorm"], eps), layer.gate_up)
            h = h + F.linear(act, layer.down)
        return h if self.cfg.skip_loop_final_norm else rms_norm(h, self.norm, eps)

    def coda(self, hidden: torch.Tensor, *_boundary: Any) -> torch.Tensor:
        if self.cfg.skip_loop_final_norm:
            hidden = rms_norm(hidden, self.norm, self.cfg.rms_norm_eps)
        return super().coda(hidden)


def _build_reference(cfg: NanbeigeConfig, weights: dict[str, torch.Tensor]):
    from rlt.platform.models.nanbeige_reference import NanbeigeReference

    return NanbeigeReference(cfg, weights)


NANBEIGE = ModelFamily(
    model_type="nanbeige",
    parse_config=NanbeigeConfig.from_dict,
    expected_weights=nanbeige_expected_weights,
    build_runtime=NanbeigeModel,
    build_reference=_build_reference,
    default_stop_token_ids=(166101,),  # eos of the release config (models.md §3.1, §7)
    config_eos_stops=True,
    optional_weights=tied_head_optional,
)
