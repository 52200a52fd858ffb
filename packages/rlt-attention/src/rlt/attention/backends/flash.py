"""FlashAttention adapters: FA4 (``flash_attn.cute``), FA3 (``flash_attn_interface``), FA2 (``flash_attn``).

Each adapter imports its package on first use only, so it is an optional extra, never a hard
dependency; the registry marks it unavailable when the package does not import. All three take
the packed batch as FlashAttention's varlen form (``cu_seqlens_q = query_start_loc``, KV lengths
from ``seq_lens``; causal, bottom-right aligned, as rlt's contract) over the paged cache
``k[layer]`` / ``v[layer]`` ``[blocks, block_size, kv_heads, d]`` with one page table per row:

* FA4: ``flash_attn_varlen_func(..., page_table=, seqused_k=)`` (page_table excludes cu_seqlens_k);
* FA3: ``flash_attn_with_kvcache(..., page_table=, cache_seqlens=, cu_seqlens_q=)``;
* FA2: ``flash_attn_varlen_func(..., block_table=, cu_seqlens_k=)`` (pages a multiple of 256).

LAST_EXITED. FlashAttention reads one page table per row; it cannot apply rlt's per-token
version map (a query at depth q reads token j from plane ``min(q, token_depth[j])``). The
adapters pass each row the page table of its own plane (gathered on the device, no copies), which
is exact exactly when every context token of the row reached at least the row's depth — always
so under fixed-depth serving (exit_threshold 1.0: every token runs every loop, prompts run at
full depth), not after an adaptive early exit. Their spec says so (``depth_indirection=False``)
and ``rlt.platform.attention_select`` refuses them for LAST_EXITED unless the caller declares that
no request can exit early; SHARED (one plane) is always exact. ``strict=True`` makes ``forward``
verify the condition on the device and raise (a host sync: for tests and debugging, not graphs).

Fresh prompt rows (``AttentionMetadata.fresh``: every row starts at position 0, as a whole prompt or
its first chunk does) attend only to keys computed in the same call. With ``dense_fresh`` such a call
takes the step's K/V themselves (the model's ``new_kv``, the values just stored) and runs the package's
dense ``flash_attn_varlen_func`` with ``cu_seqlens_k = cu_seqlens_q`` instead of gathering pages: on SM90
FA4's paged prefill loads K/V tiles page by page, its dense one through TMA. Exact for the same reason as
above: those keys are the pages' contents. Default (``dense_fresh=None``): on for FA4 (H200, 8K prefill
with FA4 for prompt rows: 45.6-45.9K tok/s vs 44.5-44.7K paged, benchmarks/results/h200-20261205-lease8),
off for FA3 / FA2 (never run here); ``RLT_DENSE_PREFILL=0`` / ``=1`` overrides.

Specs are what each package documents: FA kernels take fp16/bf16 only.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

from rlt.attention.backend import AttentionBackend, BackendSpec, dense_prefill_switch
from rlt.attention.kv_cache import KVCache, KVLayout, RowScatter, portable_row_scatter
from rlt.attention.metadata import AttentionMetadata

_HALF = frozenset({torch.float16, torch.bfloat16})


def row_plane_page_table(kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
    """``[R, max_pages]`` int32: each row's page table for its own depth plane (plane 0 if SHARED)."""
    bt = meta.block_tables
    if kv.layout is KVLayout.SHARED or bt.shape[1] == 1:
        table = bt[:, 0, :]
    else:
        plane = meta.query_depth.long().clamp(0, bt.shape[1] - 1)
        table = bt.gather(1, plane.view(-1, 1, 1).expand(-1, 1, bt.shape[2])).squeeze(1)
    return table.to(torch.int32).contiguous()


def shallower_history(kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
    """Device bool: does any context key of any row live on a plane shallower than the row's depth?

    That is exactly when reading the row's own plane (what FlashAttention can do) differs from
    LAST_EXITED. Always False for SHARED.
    """
    if kv.layout is KVLayout.SHARED or kv.token_depth is None:
        return torch.zeros((), dtype=torch.bool, device=meta.seq_lens.device)
    bs = kv.block_size
    pos = torch.arange(max(meta.max_seq_len, 1), device=meta.seq_lens.device)
    page = (pos // bs).clamp_max(meta.block_tables.shape[2] - 1)
    block0 = meta.block_tables[:, 0, :].long().gather(1, page.expand(meta.block_tables.shape[0], -1))
    stamped = kv.token_depth.view(-1)[block0 * bs + pos % bs]
    valid = pos[None, :] < meta.seq_lens.long()[:, None]
    return ((stamped < meta.query_depth[:, None]) & valid).any()


def _first(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, (tuple, list)) else result


class _FlashBackend(AttentionBackend):
    """Shared plumbing; subclasses name the module and make the call."""

    module: str = ""  # the package imported; its ``flash_attn_varlen_func`` also serves fresh rows densely
    dense_fresh_default = False  # True only where the dense call was measured to pay on the H200 (FA4)

    def __init__(self, *, strict: bool = False, dense_fresh: bool | None = None,
                 scatter: RowScatter = portable_row_scatter) -> None:
        super().__init__(scatter=scatter)
        self.strict = strict
        #: fresh prompt rows read the step's K/V (``new_kv``) densely (module docstring)
        self.takes_new_kv = dense_prefill_switch(self.dense_fresh_default) if dense_fresh is None else dense_fresh
        self._fn: Callable | None = None
        self._dense_fn: Callable | None = None
        self._table_meta: AttentionMetadata | None = None
        self._table: torch.Tensor | None = None

    def _function(self) -> Callable:
        raise NotImplementedError

    def _call(self, fn: Callable, q, k, v, table, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        raise NotImplementedError

    def _page_table(self, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        # One gather per step, reused by every layer and loop of it (the metadata is per step).
        if self._table_meta is not meta:
            self._table = row_plane_page_table(kv, meta)
            self._table_meta = meta
        return self._table

    def _dense(self, q, k, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of fresh rows over their own K/V ``[N, kv_heads, d]`` (no pages)."""
        if self._dense_fn is None:
            self._dense_fn = importlib.import_module(self.module).flash_attn_varlen_func
        qsl, longest = meta.query_start_loc, meta.max_query_len
        return _first(self._dense_fn(q, k, v, cu_seqlens_q=qsl, cu_seqlens_k=qsl, max_seqlen_q=longest,
                                     max_seqlen_k=longest, softmax_scale=scale, causal=True))

    def forward(
        self, query: torch.Tensor, kv: KVCache, layer: int, meta: AttentionMetadata, scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        n, nh, d = query.shape
        if query.dtype not in _HALF:
            raise ValueError(f"{self.name} takes float16/bfloat16 only, got {query.dtype}; use --dtype bfloat16 "
                             "or the triton backend for float32")
        if n == 0:
            return query.new_empty((0, nh * d))
        q = query if query.stride(-1) == 1 else query.contiguous()
        if new_kv is not None and self.takes_new_kv and meta.fresh:
            return self._dense(q, *new_kv, meta, scale).reshape(n, nh * d)
        if self.strict and bool(shallower_history(kv, meta)):
            raise RuntimeError(
                f"{self.name}: a context token exited shallower than its query row's depth; FlashAttention "
                "cannot read LAST_EXITED history (use the triton backend, SHARED layout, or exit_threshold 1.0)"
            )
        if self._fn is None:
            self._fn = self._function()
        out = self._call(self._fn, q, kv.k[layer], kv.v[layer], self._page_table(kv, meta), meta, scale)
        return out.reshape(n, nh * d)


class FA4Backend(_FlashBackend):
    """FlashAttention-4 (CuTe DSL, ``pip install flash-attn-4``). SM90 has no split-KV in FA4."""

    name = "fa4"
    module = "flash_attn.cute"
    dense_fresh_default = True
    spec = BackendSpec(dtypes=_HALF, head_dims=frozenset({64, 96, 128}), block_size_multiple=16,
                       packed_prefill=True, graph_safe=False, depth_indirection=False)

    def _function(self) -> Callable:
        return importlib.import_module(self.module).flash_attn_varlen_func

    def _call(self, fn, q, k, v, table, meta, scale):
        return _first(fn(
            q, k, v, cu_seqlens_q=meta.query_start_loc, seqused_k=meta.seq_lens,
            max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len, page_table=table,
            softmax_scale=scale, causal=True,
        ))


class FA3Backend(_FlashBackend):
    """FlashAttention-3 (Hopper build, module ``flash_attn_interface``)."""

    name = "fa3"
    module = "flash_attn_interface"
    spec = BackendSpec(dtypes=_HALF, head_dims=frozenset({64, 96, 128, 192, 256}), block_size_multiple=1,
                       packed_prefill=True, graph_safe=True, depth_indirection=False)

    def _function(self) -> Callable:
        return importlib.import_module(self.module).flash_attn_with_kvcache

    def _call(self, fn, q, k, v, table, meta, scale):
        return _first(fn(
            q, k, v, cache_seqlens=meta.seq_lens, page_table=table, cu_seqlens_q=meta.query_start_loc,
            max_seqlen_q=meta.max_query_len, softmax_scale=scale, causal=True,
        ))


class FA2Backend(_FlashBackend):
    """FlashAttention-2 (``pip install flash-attn``); its paged path needs pages of a multiple of 256."""

    name = "fa2"
    module = "flash_attn"
    spec = BackendSpec(dtypes=_HALF, head_dims=frozenset(range(8, 257, 8)), block_size_multiple=256,
                       packed_prefill=True, graph_safe=True, depth_indirection=False)

    def _function(self) -> Callable:
        return importlib.import_module(self.module).flash_attn_varlen_func

    def _call(self, fn, q, k, v, table, meta, scale):
        seq = meta.seq_lens
        cu_k = torch.zeros(seq.shape[0] + 1, dtype=torch.int32, device=seq.device)
        cu_k[1:] = torch.cumsum(seq, 0)
        return _first(fn(
            q, k, v, cu_seqlens_q=meta.query_start_loc, cu_seqlens_k=cu_k, max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len, softmax_scale=scale, causal=True, block_table=table,
        ))
