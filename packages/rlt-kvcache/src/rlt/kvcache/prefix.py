"""The depth-aware prefix index: full prompt pages by a hash chain, one block per plane per page.

A page's key is ``H(key of the previous page, the page's tokens)`` seeded with a namespace that
covers everything else its KV depends on: the model, dtype, KV layout, block size and the number
of depth planes the prompt was run through (a prompt run with ``max_loops`` 2 has no KV at depths
2-3, and its plane-0 version map says depth 1, so it is a different entry from the same tokens run
through 4 loops). An entry holds one reference on each of its blocks. Entries whose blocks nobody
else holds are *evictable*: they count as free, in LRU order. Must not: allocate blocks or decide
when a page is published (the KV manager does both, after the device has written the page).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import attrs
import numpy as np


def namespace_key(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def page_keys(namespace: bytes, tokens: Sequence[int], block_size: int, num_pages: int) -> list[bytes]:
    """Chain keys of the first ``num_pages`` full pages of ``tokens``."""
    keys, prev = [], namespace
    arr = np.asarray(tokens[: num_pages * block_size], dtype=np.int64)
    for i in range(num_pages):
        prev = hashlib.blake2b(prev + arr[i * block_size:(i + 1) * block_size].tobytes(), digest_size=16).digest()
        keys.append(prev)
    return keys


@attrs.define(eq=False)
class Entry:
    key: bytes
    blocks: tuple[int, ...]  # one per plane, plane 0 first


class PrefixIndex:
    def __init__(self) -> None:
        self.entries: dict[bytes, Entry] = {}
        #: entries held only by the index, least recently used first
        self.evictable: OrderedDict[bytes, Entry] = OrderedDict()
        self.evictable_blocks = 0
        #: plane-0 block -> entry, to find the entry of a page a slot gives back
        self.by_block: dict[int, Entry] = {}
        self.evictions = 0

    @property
    def num_pages(self) -> int:
        return len(self.entries)

    def lookup(self, keys: Sequence[bytes]) -> list[Entry]:
        """The entries of the longest cached run of ``keys`` from the first one."""
        out = []
        for k in keys:
            e = self.entries.get(k)
            if e is None:
                break
            out.append(e)
        return out

    def add(self, key: bytes, blocks: tuple[int, ...]) -> Entry:
        e = Entry(key, blocks)
        self.entries[key] = e
        self.by_block[blocks[0]] = e
        return e

    def set_evictable(self, e: Entry, evictable: bool) -> None:
        if evictable and e.key not in self.evictable:
            self.evictable[e.key] = e
            self.evictable_blocks += len(e.blocks)
        elif not evictable and e.key in self.evictable:
            del self.evictable[e.key]
            self.evictable_blocks -= len(e.blocks)

    def pop_lru(self) -> Entry:
        key, e = self.evictable.popitem(last=False)
        self.evictable_blocks -= len(e.blocks)
        del self.entries[key]
        del self.by_block[e.blocks[0]]
        self.evictions += 1
        return e
