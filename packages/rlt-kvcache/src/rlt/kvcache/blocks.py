"""The block pool of rlt-kvcache: free list, refcounts and the step fence.

A block is held by owners (slots, and the prefix index); ``refcount`` counts them. A block whose
count drops to zero is free again, except while a step is open (:meth:`BlockPool.open_fence`):
then it waits in *limbo* until the step has completed, so a block a running step may still read
is never handed out again. Must not: know about requests, pages, planes or device storage.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.refcount = np.zeros(num_blocks, dtype=np.int32)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._limbo: list[int] = []
        self.fenced = False

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (limbo excluded)."""
        return len(self._free)

    @property
    def free_blocks(self) -> frozenset[int]:
        return frozenset(self._free)

    @property
    def limbo_blocks(self) -> frozenset[int]:
        return frozenset(self._limbo)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"block pool: need {n} blocks, {len(self._free)} free")  # callers check first
        out = [self._free.pop() for _ in range(n)]
        self.refcount[out] = 1
        return out

    def incref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self.refcount[b] <= 0:
                raise RuntimeError(f"block {b} is not held; it cannot gain an owner")
            self.refcount[b] += 1

    def decref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self.refcount[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than it was held")
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                (self._limbo if self.fenced else self._free).append(b)

    def open_fence(self) -> None:
        """A step that reads the blocks held now is in flight: hold back what is freed until it ends."""
        self.fenced = True

    def close_fence(self) -> None:
        self.fenced = False
        self._free.extend(self._limbo)
        self._limbo.clear()
