"""Depth-aware paged KV storage and the ops that write it.

Layout (one tensor pair for all layers, so a step's metadata addresses every layer the same way)::

    k, v         [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    token_depth  [num_blocks, block_size]  int32  (the "version map", LAST_EXITED only)

Blocks are a single pool shared by every depth plane; a request owns one page table per plane
(``block_tables[row, plane, page]``), so plane ``p`` of page ``i`` of a request is the physical
block ``block_tables[row, p, i]``.

LAST_EXITED semantics are resolved by indirection, never by copying pages: ``token_depth`` holds,
for the plane-0 slot of every token, the deepest plane that holds that token's KV. The step that
runs a token at depth ``d`` stamps ``d`` there before its layers run, so when the token exits the
map already says where its last KV lives. A query at depth ``q`` reads an earlier token's KV from
plane ``min(q, token_depth)``. Tokens of the running chunk read as depth ``q`` (they were just
stamped ``q``), which is what causal attention within a chunk needs.

SHARED keeps one plane: every loop overwrites the token's slot, so later tokens always read the
last version written; no map is kept.

This module does not allocate blocks (that is host bookkeeping in ``rlt.platform``); it owns the
device tensors and the indexed writes.
"""

from __future__ import annotations

import enum
from typing import Callable

import attrs
import torch


class KVLayout(str, enum.Enum):
    """How loop depths map onto KV planes."""

    LAST_EXITED = "last_exited"
    SHARED = "shared"


# Signature of an indexed row update ``dst2d[index] = rows`` (ScatterND style): the portable
# version is ``index_copy_``; Ascend passes ``torch_npu.npu_scatter_nd_update_``.
RowScatter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def portable_row_scatter(dst2d: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``dst2d[index[i]] = rows[i]`` for every i, on any device."""
    dst2d.index_copy_(0, index, rows)


@attrs.define(eq=False)
class KVCache:
    """Device storage of a depth-aware paged KV pool."""

    k: torch.Tensor
    v: torch.Tensor
    token_depth: torch.Tensor | None
    layout: KVLayout
    num_planes: int

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        num_planes: int,
        layout: KVLayout,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> "KVCache":
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        k = torch.zeros(shape, dtype=dtype, device=device)
        v = torch.zeros(shape, dtype=dtype, device=device)
        token_depth = None
        planes = num_planes
        if layout is KVLayout.SHARED:
            planes = 1
        else:
            token_depth = torch.zeros((num_blocks, block_size), dtype=torch.int32, device=device)
        return cls(k=k, v=v, token_depth=token_depth, layout=layout, num_planes=planes)

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        # K and V, plus the int32 version map entry per slot.
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem + block_size * 4

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    def write(
        self,
        layer: int,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
        scatter: RowScatter = portable_row_scatter,
    ) -> None:
        """Write post-RoPE ``key``/``value`` ``[N, kv_heads, head_dim]`` at flat slots ``[N]``."""
        n = key.shape[0]
        kf = self.k[layer].view(-1, key.shape[1] * key.shape[2])
        vf = self.v[layer].view(-1, value.shape[1] * value.shape[2])
        scatter(kf, slot_mapping, key.reshape(n, -1).to(kf.dtype))
        scatter(vf, slot_mapping, value.reshape(n, -1).to(vf.dtype))

    def stamp_depth(self, plane0_slots: torch.Tensor, depth_per_token: torch.Tensor) -> None:
        """Record that each token's deepest KV plane is now ``depth_per_token`` (LAST_EXITED)."""
        if self.token_depth is None:
            return
        self.token_depth.view(-1).index_copy_(0, plane0_slots, depth_per_token.to(torch.int32))
