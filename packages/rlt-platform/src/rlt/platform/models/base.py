"""The stage interface every looped model implements for the engine.

A token's life: PREFILL (prompt through every loop) -> CODA (LM head) -> PRELUDE (embed the
sampled token) -> RECURRENT (one loop: all layers + end-of-loop norm + gate) until exit -> CODA.
The model defines what each stage computes; the engine only sequences them per row.
"""

from __future__ import annotations

import abc
from typing import Any, Callable

import attrs
import torch
from torch import nn

from rlt.attention import AttentionBackend, AttentionMetadata, KVCache


@attrs.frozen
class ModelShape:
    """What the KV pool and the engine need to know about a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    num_loops: int
    max_position_embeddings: int


class LoopedModel(nn.Module, abc.ABC):
    shape: ModelShape

    @abc.abstractmethod
    def prelude(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Embed token ids ``[N]`` into the loop input ``[N, hidden]``."""

    @abc.abstractmethod
    def recurrent(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv: KVCache,
        attention: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One loop over every layer plus the end-of-loop norm; writes this loop's KV."""

    @abc.abstractmethod
    def exit_logit(self, hidden: torch.Tensor) -> torch.Tensor:
        """Exit-gate logit per row ``[N]`` in float32 (models without a gate return -inf)."""

    @abc.abstractmethod
    def coda(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits ``[N, vocab]`` in float32."""


@attrs.frozen
class ModelFamily:
    model_type: str
    parse_config: Callable[[dict[str, Any]], Any]
    expected_weights: Callable[[Any], dict[str, tuple[int, ...]]]
    build_runtime: Callable[[Any, dict[str, torch.Tensor]], LoopedModel]
    build_reference: Callable[[Any, dict[str, torch.Tensor]], Any]
    #: Stop token ids the family's chat format ends with.
    default_stop_token_ids: tuple[int, ...] = ()
