"""The stage interface every looped model implements for the engine, and the family record.

A token's life: PREFILL (prompt through every loop) -> CODA (LM head) -> PRELUDE (embed the
sampled token) -> RECURRENT (one loop) until exit -> CODA. The model defines what each stage
computes; the engine only sequences them per row.

The three families fill the stages differently (models.md §6):

=========  =====================  =============================================  ==========  ==========================
family     prelude                recurrent (one loop)                           exit head   coda
=========  =====================  =============================================  ==========  ==========================
Ouro       embedding              whole stack + final norm                       learned     LM head
Nanbeige   embedding              whole Llama stack + final norm (unless skip)   none        LM head
Huginn     emb x sqrt(E), blocks  adapter(concat[state, injection]) + core       none        ln_f, blocks, ln_f, head
=========  =====================  =============================================  ==========  ==========================

Optional class attributes a model sets (the engine reads them with these defaults):

* ``has_exit_gate`` (True): the model has a learned exit gate. Without one ``exit_logit`` returns
  ``-inf`` (λ = 0, so the accumulated exit probability never grows) and an engine must refuse
  adaptive exit (``exit_threshold < 1``) rather than read a gate that does not exist.
* ``boundary_attention`` (False): prelude and coda run attention layers of their own, on a
  separate single-plane KV cache of ``shape.num_boundary_layers`` layers, and ``recurrent`` needs
  the per-row injection. The extended stage signatures are documented in
  :mod:`rlt.platform.models.huginn`; models without boundary attention accept and ignore them.
  The engine serves such a model with :class:`rlt.platform.engine.boundary.BoundaryExecutor`.
* ``per_request_depth`` (False): the loop count is a per-request choice (``max_loops``) with the
  checkpoint's ``shape.num_loops`` as the default and the engine's ``--num-loops`` as the bound
  (Huginn); otherwise requests default to the engine's ``--num-loops``.
* ``has_initial_state`` (False): the recurrence starts from ``initial_state(seeds, positions,
  scales)`` (a seeded random state; scale 0 is the zero state); requests may set
  ``init_state_scale``, which is refused for other models.
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
    #: Attention layers outside the loop (Huginn's prelude + coda blocks), one KV plane each.
    num_boundary_layers: int = 0


def no_exit_gate(hidden: torch.Tensor) -> torch.Tensor:
    """``exit_logit`` of a model without a gate: -inf per row, so λ = sigmoid(-inf) = 0."""
    return torch.full((hidden.shape[0],), float("-inf"), dtype=torch.float32, device=hidden.device)


class LoopedModel(nn.Module, abc.ABC):
    shape: ModelShape
    has_exit_gate: bool = True
    boundary_attention: bool = False
    per_request_depth: bool = False
    has_initial_state: bool = False
    #: One of the model's weights (the embedding): ``dtype`` and ``device`` are read from it.
    anchor: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.anchor.dtype

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    @abc.abstractmethod
    def rotary(self, positions: torch.Tensor) -> Any:
        """The rotary tables of ``positions [N]``, passed unchanged to every stage of the step."""

    @abc.abstractmethod
    def prelude(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Embed token ids ``[N]`` into the loop input ``[N, hidden]``."""

    @abc.abstractmethod
    def recurrent(
        self,
        hidden: torch.Tensor,
        rope: Any,
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


def _no_optional_weights(cfg: Any) -> dict[str, tuple[int, ...]]:
    return {}


@attrs.frozen
class ModelFamily:
    model_type: str
    parse_config: Callable[[dict[str, Any]], Any]
    #: Every weight the runtime needs, name -> shape (the loader is strict about these).
    expected_weights: Callable[[Any], dict[str, tuple[int, ...]]]
    build_runtime: Callable[[Any, dict[str, torch.Tensor]], LoopedModel]
    build_reference: Callable[[Any, dict[str, torch.Tensor]], Any]
    #: Stop token ids the family's chat format ends with (on the real checkpoints).
    default_stop_token_ids: tuple[int, ...] = ()
    #: Token strings that end a turn; where the tokenizer has them, their ids are the stop ids
    #: (so a checkpoint with its own numbering, such as a tiny test one, stops on the same tokens).
    stop_tokens: tuple[str, ...] = ()
    #: The config's ``eos_token_id`` (int or list) is a stop id too (Nanbeige: 166101).
    config_eos_stops: bool = False
    #: Weights a checkpoint may carry that are not read (a tied head, a stored RoPE table), name ->
    #: shape: shape-checked when present, never required.
    optional_weights: Callable[[Any], dict[str, tuple[int, ...]]] = _no_optional_weights
    #: Optional weights the model reads when the checkpoint has them (Huginn's stored RoPE table),
    #: loaded in float32 whatever the serving dtype; the others are dropped after the shape check.
    optional_read: tuple[str, ...] = ()
    #: Why the engine cannot serve this family yet (None: it can).
    engine_unsupported: str | None = None

    def stop_token_ids(self, config: Any, tokenizer: Any, generation: dict | None = None) -> tuple[int, ...]:
        """The stop ids of a checkpoint: its config, tokenizer (``token_to_id(str) -> int | None``) and
        ``generation_config.json`` (``generation``), whose ``eos_token_id`` HF ``generate`` stops on."""
        ids = [i for i in (tokenizer.token_to_id(t) for t in self.stop_tokens) if i is not None]
        eos = getattr(config, "eos_token_id", None) if self.config_eos_stops else None
        ids += [eos] if isinstance(eos, int) else list(eos or ())
        gen_eos = (generation or {}).get("eos_token_id")
        ids += [gen_eos] if isinstance(gen_eos, int) else [i for i in (gen_eos or ()) if isinstance(i, int)]
        return tuple(dict.fromkeys(ids)) or self.default_stop_token_ids
