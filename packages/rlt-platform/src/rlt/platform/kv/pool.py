"""Host bookkeeping of the depth-aware paged KV pool: the base :class:`KVManager`.

Blocks are one pool shared by all depth planes. A request holds, per slot, one page table per
plane it can reach (a request limited to ``max_loops`` loops never touches deeper planes; SHARED
has one plane). Page tables live in one host array ``block_tables[slot, plane, page]`` so a step
gathers the rows it runs with one fancy index. Allocation here is all-or-nothing at admission —
every page a request can ever write — so the base engine never overcommits and never preempts
(incremental allocation, preemption and the prefix cache belong to rlt-kvcache, behind the same
protocol). Device storage (:class:`rlt.attention.KVCache`) is not touched here.
"""

from __future__ import annotations

import numpy as np

from rlt.attention import KVLayout


class OutOfBlocks(Exception):
    pass


class BlockAllocator:
    """Free list and refcounts of the pool's blocks (refcounts let a prefix cache share them)."""

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
        # the same blocks, in the same order, as n pops (an 8K prompt takes 2,048 blocks at admission)
        out = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        self.refcount[out] = 1
        return out

    def free(self, blocks) -> None:
        idx = np.asarray(blocks, dtype=np.int64)
        if len(idx) and (self.refcount[idx] == 1).all() and len(np.unique(idx)) == len(idx):
            self.refcount[idx] = 0  # the common case (no block shared): as the loop below, in bulk
            self._free.extend(idx.tolist())
            return
        for b in blocks:
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self._free.append(b)


class PagedKVManager:
    """Page tables per slot and plane over a :class:`BlockAllocator` (all-or-nothing admission)."""

    def __init__(self, *, layout: KVLayout, block_size: int, num_blocks: int, num_planes: int,
                 max_num_seqs: int, max_pages: int) -> None:
        self.layout = layout
        self.block_size = block_size
        self.num_planes = num_planes
        self.max_pages = max_pages
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables = np.zeros((max_num_seqs, num_planes, max_pages), dtype=np.int32)
        self._owned: dict[int, list[int]] = {}
        self._reserved: list[int] = []

    @classmethod
    def from_context(cls, ctx) -> "PagedKVManager":
        kv = ctx.kv
        return cls(layout=kv.layout, block_size=kv.block_size, num_blocks=kv.num_blocks, num_planes=kv.num_planes,
                   max_num_seqs=ctx.max_num_seqs, max_pages=kv.max_pages)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def usage(self) -> float:
        return 0.0 if self.num_blocks == 0 else 1.0 - self.num_free / self.num_blocks

    def planes_for(self, max_loops: int) -> int:
        return 1 if self.layout is KVLayout.SHARED else min(max_loops, self.num_planes)

    def blocks_for(self, num_positions: int, max_loops: int) -> int:
        return -(-num_positions // self.block_size) * self.planes_for(max_loops)

    def can_ever_fit(self, request) -> bool:
        return self.blocks_for(request.max_positions, request.max_loops) <= self.usable_blocks

    @property
    def usable_blocks(self) -> int:
        """Blocks requests can ever hold: the pool less what :meth:`reserve` took."""
        return self.num_blocks - len(self._reserved)

    def allocate(self, slot: int, request) -> bool:
        """Allocate every page ``request`` can ever touch, or nothing (returns False)."""
        pages = -(-request.max_positions // self.block_size)
        planes = self.planes_for(request.max_loops)
        if pages * planes > self.num_free:
            return False
        blocks = self.allocator.allocate(pages * planes)
        table = np.asarray(blocks, dtype=np.int32).reshape(planes, pages)
        self.block_tables[slot] = 0
        self.block_tables[slot, :planes, :pages] = table
        # Unreachable planes alias plane 0 so any index the kernels form stays in bounds.
        self.block_tables[slot, planes:, :pages] = table[0]
        self._owned[slot] = blocks
        return True

    def grow(self, slot: int, request, num_positions: int) -> bool:
        return num_positions <= request.max_positions  # everything was allocated at admission

    def match_prefix(self, request) -> int:
        return 0

    def free(self, slot: int) -> None:
        self.allocator.free(self._owned.pop(slot, ()))
        self.block_tables[slot] = 0

    def reserve(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks out of the pool for good (a feature's private blocks, e.g.
        rlt-spec's wide chains), or None when fewer are free."""
        if n > self.num_free:
            return None
        blocks = self.allocator.allocate(n)
        self._reserved.extend(blocks)
        return blocks
