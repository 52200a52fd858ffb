"""KVCacheManager: the rlt-kvcache :class:`KVManager` (host bookkeeping only).

Pages are allocated as positions are reached (``grow``), all planes a request can use together
(one block per plane per page), or — with ``incremental=False`` — every page at admission like
the base manager. With a :class:`PrefixIndex` (``prefix_cache=True``) admission first claims the
cached pages of the prompt's longest cached prefix (whole pages, never the page holding the last
prompt token's position: that token is always recomputed, its hidden state produces the first
token); prompt pages are published once a prompt chunk covering them has run all its loops.
Cached pages nobody else holds count as free and are evicted LRU when blocks are needed (a released chain becomes evictable tail first, so its head stays reachable longest).

In-flight prefixes: the prompt pages an admitted request is still computing (not yet published)
are registered under their chain keys (:meth:`waits_for_inflight`), so a request whose first
uncached page another running request is computing can wait for its publication instead of
computing the same pages again (the scheduler defers its admission).

The step fence: :meth:`open_step` when a step that reads the slots' pages is handed to the
executor, :meth:`close_step` when it completed; blocks released in between are held back until
then. :meth:`audit` checks every invariant (for tests). Must not: touch device storage (the
swapper does), or decide who runs (the scheduler policy does).
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Iterable

import attrs
import numpy as np

from rlt.attention import KVLayout
from rlt.kvcache.blocks import BlockPool
from rlt.kvcache.metrics import kv_metrics
from rlt.kvcache.prefix import PrefixIndex, namespace_key, page_keys


class KVAuditError(AssertionError):
    """A broken invariant of the KV bookkeeping (leak, double ownership, freed while in use)."""


@attrs.define(eq=False)
class SlotPages:
    planes: int
    pages: list[tuple[int, ...]] = attrs.field(factory=list)  # per page: one block per plane
    keys: list[bytes] = attrs.field(factory=list)  # chain keys of the full prompt pages
    published: int = 0  # pages [0, published) are in the index (or were skipped as duplicates)


class KVCacheManager:
    def __init__(self, *, layout: KVLayout, block_size: int, num_blocks: int, num_planes: int, max_num_seqs: int,
                 max_pages: int, incremental: bool = True, prefix_cache: bool = False,
                 namespace: tuple = ()) -> None:
        self.layout = layout
        self.block_size = block_size
        self.num_planes = num_planes
        self.max_pages = max_pages
        self.incremental = incremental
        self.pool = BlockPool(num_blocks)
        self.index = PrefixIndex() if prefix_cache else None
        self._namespace = namespace
        self.block_tables = np.zeros((max_num_seqs, num_planes, max_pages), dtype=np.int32)
        self._slots: dict[int, SlotPages] = {}
        #: blocks taken out of the pool for good by :meth:`reserve` (one owner each)
        self._reserved: list[int] = []
        self._step_pages: list[list[tuple[int, ...]]] = []
        #: chain key of a prompt page an admitted request is computing (not yet published) -> its slot
        self._inflight: dict[bytes, int] = {}
        #: request -> its prompt's chain keys (hashed once per request, not at every admission attempt)
        self._prompt_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._waited: weakref.WeakSet = weakref.WeakSet()
        # prefix-cache counters
        self.query_tokens = 0
        self.hit_tokens = 0
        self.inflight_waits = 0  # requests whose admission waited for an in-flight prefix

    @classmethod
    def from_context(cls, ctx, *, incremental: bool, prefix_cache: bool) -> "KVCacheManager":
        kv = ctx.kv
        ns = (ctx.model_dir, ctx.model_type, str(ctx.dtype), kv.layout.value, kv.block_size)
        return cls(layout=kv.layout, block_size=kv.block_size, num_blocks=kv.num_blocks, num_planes=kv.num_planes,
                   max_num_seqs=ctx.max_num_seqs, max_pages=kv.max_pages, incremental=incremental,
                   prefix_cache=prefix_cache, namespace=ns)

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks available to a new owner: free now plus cached pages held only by the index."""
        return self.pool.num_free + (self.index.evictable_blocks if self.index else 0)

    def _available(self) -> int:
        """Blocks :meth:`_take` can hand out now: ``num_free``, less the cached pages while a step's
        fence is open (an evicted page's blocks would wait in limbo until the step completes). Only
        a component growing KV after the policy opened the step meets the difference (rlt-spec's
        rounds): its growth then fails and the round waits, instead of the eviction running dry."""
        return self.num_free if not self.pool.fenced else self.pool.num_free

    def planes_for(self, max_loops: int) -> int:
        return 1 if self.layout is KVLayout.SHARED else min(max_loops, self.num_planes)

    def pages_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def blocks_for(self, num_positions: int, max_loops: int) -> int:
        return self.pages_for(num_positions) * self.planes_for(max_loops)

    def can_ever_fit(self, request) -> bool:
        return self.blocks_for(request.max_positions, request.max_loops) <= self.usable_blocks

    @property
    def usable_blocks(self) -> int:
        """Blocks requests can ever hold: the pool less what :meth:`reserve` took."""
        return self.num_blocks - len(self._reserved)

    def num_pages(self, slot: int) -> int:
        sp = self._slots.get(slot)
        return 0 if sp is None else len(sp.pages)

    def held_blocks(self, slot: int) -> int:
        sp = self._slots.get(slot)
        return 0 if sp is None else len(sp.pages) * sp.planes

    def growth_blocks(self, slot: int, num_positions: int) -> int:
        """Blocks ``grow(slot, ..., num_positions)`` would take."""
        sp = self._slots[slot]
        return max(0, self.pages_for(num_positions) - len(sp.pages)) * sp.planes

    def table(self, slot: int) -> np.ndarray:
        """``[planes, pages]`` blocks the slot holds (a copy)."""
        sp = self._slots[slot]
        return np.asarray(sp.pages, dtype=np.int64).reshape(len(sp.pages), sp.planes).T.copy()

    # -- prefix cache ----------------------------------------------------------------------------
    def _keys(self, request) -> list[bytes]:
        if self.index is None or request.params.prompt_logprobs is not None:
            return []  # cached positions would have no prompt logprobs
        keys = self._prompt_keys.get(request)
        if keys is None:
            planes = self.planes_for(request.max_loops)
            ns = namespace_key(*self._namespace, planes)
            keys = page_keys(ns, request.prompt_token_ids, self.block_size, request.num_prompt // self.block_size)
            self._prompt_keys[request] = keys
        return keys

    def match_pages(self, request, keys: list[bytes] | None = None) -> int:
        """Cached full pages at the start of the prompt, never the last prompt token's page."""
        keys = self._keys(request) if keys is None else keys
        if not keys:
            return 0
        limit = (request.num_prompt - 1) // self.block_size
        return len(self.index.lookup(keys[:limit]))

    def match_prefix(self, request) -> int:
        return self.match_pages(request) * self.block_size

    def waits_for_inflight(self, request) -> bool:
        """Whether the first page of the request's prompt that is not cached (and that it could take
        from the cache) is being computed by an admitted request: admitting it now would compute
        the same page again; once that page is published it is a hit."""
        if not self._inflight:
            return False
        keys = self._keys(request)
        if not keys:
            return False
        h = self.match_pages(request, keys)
        if h >= (request.num_prompt - 1) // self.block_size or keys[h] not in self._inflight:
            return False
        if request not in self._waited:
            self._waited.add(request)
            self.inflight_waits += 1
        return True

    def _release_inflight(self, slot: int, keys: list[bytes]) -> None:
        for k in keys:
            if self._inflight.get(k) == slot:
                del self._inflight[k]

    # -- allocation ------------------------------------------------------------------------------
    def _take(self, n: int) -> list[int]:
        while self.pool.num_free < n:  # evict cached pages nobody holds, least recently used first
            self.pool.decref(self.index.pop_lru().blocks)
        return self.pool.take(n)

    def reserve(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks out of the pool for good (a feature's private blocks, e.g.
        rlt-spec's wide chains; cached pages are not evicted for them), or None when fewer are free."""
        if n > self.pool.num_free:
            return None
        blocks = self.pool.take(n)
        self._reserved.extend(blocks)
        return blocks

    def _append_pages(self, slot: int, sp: SlotPages, blocks: list[int]) -> None:
        first = len(sp.pages)
        new = [tuple(blocks[i * sp.planes:(i + 1) * sp.planes]) for i in range(len(blocks) // sp.planes)]
        sp.pages.extend(new)
        if new:
            t = np.asarray(new, dtype=np.int32).T  # [planes, n]
            last = first + len(new)
            self.block_tables[slot, :sp.planes, first:last] = t
            # Unreachable planes alias plane 0 so any index the kernels form stays in bounds.
            self.block_tables[slot, sp.planes:, first:last] = t[0]

    def admit(self, slot: int, request, num_positions: int, *, cached_pages: int = 0, reserve: int = 0,
              use_cache: bool = True) -> bool:
        """Give ``slot`` pages covering ``num_positions`` positions, the first ``cached_pages`` from
        the prefix index (as :meth:`match_pages` found them), keeping ``reserve`` blocks free for
        others. All or nothing: on False nothing changed (nothing was evicted)."""
        if slot in self._slots:
            raise RuntimeError(f"slot {slot} already holds KV pages")
        planes = self.planes_for(request.max_loops)
        keys = self._keys(request) if use_cache else []
        hits = self.index.lookup(keys[:cached_pages]) if cached_pages else []
        if len(hits) != cached_pages:
            raise RuntimeError(f"prefix index changed between match ({cached_pages} pages) and admission")
        new_pages = max(0, self.pages_for(num_positions) - len(hits))
        claimed = sum(len(e.blocks) for e in hits if e.key in self.index.evictable) if hits else 0
        if new_pages * planes + claimed + reserve > self._available():
            return False
        sp = SlotPages(planes, keys=keys, published=len(hits))
        for e in hits:
            self.pool.incref(e.blocks)
            self.index.set_evictable(e, False)
        self._slots[slot] = sp
        for k in keys[len(hits):]:  # the pages this slot computes: others sharing them wait for them
            if k not in self.index.entries:
                self._inflight.setdefault(k, slot)
        self.block_tables[slot] = 0
        self._append_pages(slot, sp, [b for e in hits for b in e.blocks])
        self._append_pages(slot, sp, self._take(new_pages * planes))
        if use_cache and self.index is not None:
            self.query_tokens += request.num_prompt
            self.hit_tokens += len(hits) * self.block_size
        return True

    def allocate(self, slot: int, request) -> bool:
        """Protocol admission: the whole lifetime (full reservation) or the whole prompt (incremental)."""
        n = request.num_prompt if self.incremental else request.max_positions
        return self.admit(slot, request, n, cached_pages=self.match_pages(request))

    def grow(self, slot: int, request, num_positions: int) -> bool:
        sp = self._slots[slot]
        need = self.growth_blocks(slot, num_positions)
        if need == 0:
            return True
        if need > self._available():
            return False
        self._append_pages(slot, sp, self._take(need))
        return True

    def publish(self, slot: int, num_positions: int) -> None:
        """Positions ``[0, num_positions)`` of the slot's prompt have run every loop: index its full pages."""
        sp = self._slots.get(slot)
        if self.index is None or sp is None:
            return
        upto = min(num_positions // self.block_size, len(sp.keys), len(sp.pages))
        self._release_inflight(slot, sp.keys[sp.published:upto])
        for i in range(sp.published, upto):
            if sp.keys[i] not in self.index.entries:
                blocks = sp.pages[i]
                self.pool.incref(blocks)
                self.index.add(sp.keys[i], blocks)
        sp.published = max(sp.published, upto)

    def free(self, slot: int) -> None:
        sp = self._slots.pop(slot, None)
        self.block_tables[slot] = 0
        if sp is None:
            return
        self._release_inflight(slot, sp.keys[sp.published:])
        for page in reversed(sp.pages):  # deeper pages become evictable first: a chain loses its tail first
            self.pool.decref(page)
            if self.index is not None:
                e = self.index.by_block.get(page[0])
                if e is not None and self.pool.refcount[page[0]] == 1:
                    self.index.set_evictable(e, True)

    # -- the step fence --------------------------------------------------------------------------
    def open_step(self, slots: Iterable[int]) -> None:
        # the page lists themselves (no copy: O(rows)); they do not change while the step is open
        self._step_pages = [self._slots[s].pages for s in slots]
        self.pool.open_fence()

    def close_step(self) -> None:
        self._step_pages = []
        self.pool.close_fence()

    def feature_metrics(self) -> list:
        return kv_metrics(self) if self.index is not None else []

    # -- checks ----------------------------------------------------------------------------------
    def audit(self) -> None:
        """Raise :class:`KVAuditError` unless every block is exactly one of free, in limbo, or held
        with a refcount equal to its owners; page tables match; no block of an open step is free."""
        owners: Counter[int] = Counter()
        for slot, sp in self._slots.items():
            for i, page in enumerate(sp.pages):
                if len(page) != sp.planes:
                    raise KVAuditError(f"slot {slot} page {i} has {len(page)} blocks for {sp.planes} planes")
                owners.update(page)
                if list(self.block_tables[slot, :sp.planes, i]) != list(page):
                    raise KVAuditError(f"slot {slot} page {i}: block table disagrees with its pages")
            if len(set(b for p in sp.pages for b in p)) != len(sp.pages) * sp.planes:
                raise KVAuditError(f"slot {slot} holds one block twice")
        owners.update(self._reserved)
        evictable_blocks = 0
        if self.index is not None:
            for e in self.index.entries.values():
                owners.update(e.blocks)
                if self.index.by_block.get(e.blocks[0]) is not e:
                    raise KVAuditError("prefix index: block map out of date")
                held_only_by_index = all(self.pool.refcount[b] == 1 for b in e.blocks)
                if held_only_by_index != (e.key in self.index.evictable):
                    raise KVAuditError(f"prefix entry evictable={e.key in self.index.evictable} but "
                                       f"refcounts {[int(self.pool.refcount[b]) for b in e.blocks]}")
            evictable_blocks = sum(len(e.blocks) for e in self.index.evictable.values())
            for k, slot in self._inflight.items():
                sp = self._slots.get(slot)
                if sp is None or k not in sp.keys[sp.published:]:
                    raise KVAuditError(f"in-flight prefix page of slot {slot} that the slot does not compute")
            if evictable_blocks != self.index.evictable_blocks:
                raise KVAuditError("prefix index: evictable block count out of date")
        free, limbo = self.pool.free_blocks, self.pool.limbo_blocks
        if len(free) != self.pool.num_free:
            raise KVAuditError("a block is on the free list twice")
        if free & limbo:
            raise KVAuditError(f"blocks both free and in limbo: {sorted(free & limbo)[:8]}")
        for b in range(self.num_blocks):
            held = owners.get(b, 0)
            if held != self.pool.refcount[b]:
                raise KVAuditError(f"block {b}: refcount {self.pool.refcount[b]} but {held} owner(s)")
            if held and (b in free or b in limbo):
                raise KVAuditError(f"block {b} is held and free")
            if not held and b not in free and b not in limbo:
                raise KVAuditError(f"block {b} leaked: no owner, not free")
        step_blocks = {b for pages in self._step_pages for page in pages for b in page}
        if step_blocks & free:
            raise KVAuditError(f"blocks read by the open step were freed: {sorted(step_blocks & free)[:8]}")
        if self.num_free != len(free) + evictable_blocks:
            raise KVAuditError("num_free disagrees with the pool and the index")
