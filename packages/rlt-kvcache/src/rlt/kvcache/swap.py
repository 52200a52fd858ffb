"""Swapping a request's KV between the device pool and host memory (pinned on CUDA).

``save(table)`` copies every plane's pages of ``table [planes, pages]`` — K, V of all layers and,
for LAST_EXITED, the plane-0 version map (``token_depth``) — into host tensors; ``restore(table,
saved)`` writes them into the blocks of another table of the same shape, wherever the request now
lives. Copies are issued on the current stream, so they are ordered after the steps that wrote the
pages and before any step that reuses the blocks. Must not: allocate or free blocks.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch


@attrs.frozen(eq=False)
class SwappedKV:
    k: torch.Tensor  # [layers, planes * pages, block_size, kv_heads, head_dim] on the host
    v: torch.Tensor
    token_depth: torch.Tensor | None  # [pages, block_size] (plane-0 blocks), LAST_EXITED only
    planes: int
    pages: int

    @property
    def nbytes(self) -> int:
        n = self.k.numel() * self.k.element_size() * 2
        return n + (0 if self.token_depth is None else self.token_depth.numel() * 4)


class HostSwapper:
    def __init__(self, cache) -> None:
        self.cache = cache
        self.device = cache.k.device
        self.pinned = self.device.type == "cuda"

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pinned)
        out.copy_(t, non_blocking=self.pinned)
        return out

    def _index(self, blocks: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.int64)).to(self.device)

    def save(self, table: np.ndarray) -> SwappedKV:
        planes, pages = table.shape
        idx = self._index(table.reshape(-1))
        c = self.cache
        depth = None
        if c.token_depth is not None:
            depth = self._host_copy(c.token_depth.index_select(0, self._index(table[0])))
        return SwappedKV(self._host_copy(c.k.index_select(1, idx)), self._host_copy(c.v.index_select(1, idx)),
                         depth, planes, pages)

    def restore(self, table: np.ndarray, saved: SwappedKV) -> None:
        """Write ``saved`` into the first ``saved.pages`` pages of ``table [planes, >= pages]``."""
        part = table[: saved.planes, : saved.pages]
        if part.shape != (saved.planes, saved.pages):
            raise ValueError(f"restore into {table.shape} blocks, saved {(saved.planes, saved.pages)}")
        idx = self._index(part.reshape(-1))
        c = self.cache
        c.k.index_copy_(1, idx, saved.k.to(self.device, non_blocking=self.pinned))
        c.v.index_copy_(1, idx, saved.v.to(self.device, non_blocking=self.pinned))
        if saved.token_depth is not None:
            c.token_depth.index_copy_(0, self._index(part[0]), saved.token_depth.to(self.device, non_blocking=self.pinned))
