"""The attention backend interface.

A backend computes causal attention for a packed batch of rows over the depth-aware paged KV
pool, and writes new K/V into it. A backend declares what it supports in a :class:`BackendSpec`
so a selector can skip an unsuitable candidate with a reason instead of failing inside a kernel.

Contract for every backend (what later lets a step be captured as a graph):

* ``forward`` reads only device tensors from :class:`AttentionMetadata` (plus its host-side
  upper bounds), never synchronises with the host, and returns ``[N, num_heads * head_dim]``
  in the query dtype;
* it resolves LAST_EXITED history through ``kv.token_depth`` (no page copies);
* queries are bottom-right aligned: token i of a row with q new tokens and context c sits at
  position ``c - q + i`` and sees keys ``0 .. c - q + i``.
"""

from __future__ import annotations

import abc
import os

import attrs
import torch

from rlt.attention.kv_cache import KVCache, RowScatter, portable_row_scatter
from rlt.attention.metadata import AttentionMetadata


class UnsuitableBackend(Exception):
    """Raised by :meth:`BackendSpec.check` when a backend cannot serve a configuration."""


@attrs.frozen
class BackendSpec:
    """What a backend supports. ``None`` means "any"."""

    dtypes: frozenset[torch.dtype] | None = None
    head_dims: frozenset[int] | None = None
    block_size_multiple: int = 1
    packed_prefill: bool = True
    graph_safe: bool = False
    #: Resolves LAST_EXITED per key through ``kv.token_depth``. False: reads each row's own plane
    #: only, which is exact only when no context token exited shallower than the row's depth.
    depth_indirection: bool = True
    #: ``write_kv`` stores each token's K/V rows at its flat slot exactly as :meth:`KVCache.write`
    #: does (a negative slot writes nothing), so a model kernel may do that store itself, fused with
    #: the projection that produces K/V (``rlt.platform.models.fused_linear``). False: the model
    #: always calls ``write_kv`` (a backend with its own store, such as Ascend's ScatterND).
    flat_slot_kv_write: bool = True

    def check(self, *, dtype: torch.dtype, head_dim: int, block_size: int) -> None:
        if self.dtypes is not None and dtype not in self.dtypes:
            raise UnsuitableBackend(f"dtype {dtype} not supported (supports {sorted(map(str, self.dtypes))})")
        if self.head_dims is not None and head_dim not in self.head_dims:
            raise UnsuitableBackend(f"head_dim {head_dim} not supported (supports {sorted(self.head_dims)})")
        if block_size % self.block_size_multiple:
            raise UnsuitableBackend(
                f"block_size {block_size} is not a multiple of {self.block_size_multiple}"
            )


class AttentionBackend(abc.ABC):
    """Base class of attention backends."""

    name: str = "abstract"
    spec: BackendSpec = BackendSpec()
    #: True when ``forward`` also takes ``new_kv=(key, value)``: this step's post-RoPE K/V ``[N, kv_heads,
    #: head_dim]`` as stored into the pages (a model passes them only then; the Triton backend's dense
    #: prefill reads fresh prompt rows' keys from them).
    takes_new_kv: bool = False

    def __init__(self, *, scatter: RowScatter = portable_row_scatter) -> None:
        self._scatter = scatter

    def prepare(self, kv: KVCache, meta: AttentionMetadata) -> AttentionMetadata:
        """Once per step, before the first layer: build per-step backend state (returned as the
        metadata every layer of the step then receives). The base backend needs none."""
        return meta

    def write_kv(
        self, kv: KVCache, layer: int, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """Write this step's post-RoPE K/V ``[N, kv_heads, head_dim]`` for ``layer``."""
        kv.write(layer, key, value, meta.slot_mapping, self._scatter)

    @abc.abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        kv: KVCache,
        layer: int,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of ``query [N, heads, head_dim]`` over the paged KV of ``layer``."""

    def describe(self) -> str:
        return self.name


def dense_prefill_switch(default: bool) -> bool:
    """Whether fresh prompt rows read the step's K/V densely: ``RLT_DENSE_PREFILL=0`` off, ``=1`` on, unset
    the backend's ``default`` (on for the Triton backend and FA4, measured on the H200 on 2026-12-05)."""
    value = os.environ.get("RLT_DENSE_PREFILL", "")
    return default if value == "" else value != "0"


def forward_with_new_kv(backend: AttentionBackend, query: torch.Tensor, kv: KVCache, layer: int,
                        meta: AttentionMetadata, scale: float,
                        new_kv: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """``backend.forward``, handing it the step's K/V only when it takes them (``takes_new_kv``)."""
    if new_kv is not None and backend.takes_new_kv:
        return backend.forward(query, kv, layer, meta, scale, new_kv=new_kv)
    return backend.forward(query, kv, layer, meta, scale)
