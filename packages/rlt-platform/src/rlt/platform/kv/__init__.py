"""Depth-aware paged KV: host-side allocation and page tables (device storage is rlt.attention.KVCache)."""

from rlt.platform.kv.pool import BlockAllocator, KVPool, OutOfBlocks

__all__ = ["BlockAllocator", "KVPool", "OutOfBlocks"]
