"""Host bookkeeping of the depth-aware paged KV pool.

Blocks are one pool shared by all depth planes. A request holds, per slot, one page table per
plane it can reach (a request limited to ``max_loops`` loops never touches deeper planes; SHARED
has one plane). Page tables live in one host array ``block_tables[slot, plane, page]`` so a step
gathers the rows it runs with one fancy index. Refcounts let later features (prefix cache) share
blocks; allocation here is all-or-nothing so admission never overcommits.
"""

from __future__ import annotations

import numpy as np
import torch

from rlt.attention import KVCache, KVLayout


class OutOfBlocks(Exception):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self.refcount = np.zeros(num_blocks, dtype=np.int32)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        self.refcount[out] = 1
        return out

    def incref(self, blocks) -> None:
        self.refcount[list(blocks)] += 1

    def free(self, blocks) -> None:
        for b in blocks:
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self._free.append(b)


class KVPool:
    """Page tables per slot and plane over a :class:`BlockAllocator`, plus the device cache."""

    def __init__(self, cache: KVCache, *, max_num_seqs: int, max_model_len: int) -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self.num_planes = cache.num_planes
        self.max_pages = -(-max_model_len // self.block_size)
        self.allocator = BlockAllocator(cache.num_blocks)
        self.block_tables = np.zeros((max_num_seqs, self.num_planes, self.max_pages), dtype=np.int32)
        self._owned: dict[int, list[int]] = {}

    @property
    def layout(self) -> KVLayout:
        return self.cache.layout

    def planes_for(self, max_loops: int) -> int:
        return 1 if self.layout is KVLayout.SHARED else min(max_loops, self.num_planes)

    def blocks_needed(self, num_positions: int, max_loops: int) -> int:
        return -(-num_positions // self.block_size) * self.planes_for(max_loops)

    def can_ever_fit(self, num_positions: int, max_loops: int) -> bool:
        return self.blocks_needed(num_positions, max_loops) <= self.allocator.num_blocks

    def can_fit_now(self, num_positions: int, max_loops: int) -> bool:
        return self.blocks_needed(num_positions, max_loops) <= self.allocator.num_free

    def reserve(self, slot: int, num_positions: int, max_loops: int) -> None:
        """Allocate every page the request can ever touch (all-or-nothing)."""
        pages = -(-num_positions // self.block_size)
        planes = self.planes_for(max_loops)
        blocks = self.allocator.allocate(pages * planes)
        table = np.asarray(blocks, dtype=np.int32).reshape(planes, pages)
        self.block_tables[slot] = 0
        self.block_tables[slot, :planes, :pages] = table
        # Unreachable planes alias plane 0 so any index the kernels form stays in bounds.
        self.block_tables[slot, planes:, :pages] = table[0]
        self._owned[slot] = blocks

    def release(self, slot: int) -> None:
        self.allocator.free(self._owned.pop(slot, ()))
        self.block_tables[slot] = 0

    @property
    def usage(self) -> float:
        total = self.allocator.num_blocks
        return 0.0 if total == 0 else 1.0 - self.allocator.num_free / total

    def device_tables(self, slots: np.ndarray, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(self.block_tables[slots]).to(device, non_blocking=True)
