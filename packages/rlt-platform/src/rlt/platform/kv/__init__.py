"""Depth-aware paged KV: host bookkeeping (block allocator, per-plane page tables)."""

from rlt.platform.kv.pool import BlockAllocator, OutOfBlocks, PagedKVManager

__all__ = ["BlockAllocator", "OutOfBlocks", "PagedKVManager"]
