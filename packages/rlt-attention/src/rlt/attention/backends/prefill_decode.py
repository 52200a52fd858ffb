"""``PREFILL+DECODE``: one backend for steps that carry prompt chunks, another for decode-only steps.

Why it exists: on CUDA the RFC makes FlashAttention the owner of packed prefill, and on the H200
FA4's causal prefill kernel is twice as fast as the Triton paged prefill (8K tokens: 0.49 vs
0.94 ms; the engine's 8K prompt 40.4K vs 34.1K tok/s). In decode FA4 loses: SM90 has no split-KV
in FA4, so one long row runs at 14% of the copy bandwidth where Triton's split-KV kernel reaches
85%, and even at 64 rows x 4K its kernel is 11% slower (benchmarks/results/h200-20261203/). So
``fa4+triton`` runs every step that holds a multi-token row (prefill, or prefill mixed with
decode rows) through FA4 and every decode-only step through Triton.

The choice is made per call from the metadata's host-side bound ``max_query_len`` — never from
device data — so it is safe inside a captured graph (a decode-only graph only ever sees the decode
backend). Both backends read the same storage layout; K/V is written by the decode backend's
writer in every step, so one writer owns the cache. The combined spec is what both support; its
``depth_indirection`` is False if either lacks it (then only fixed-depth serving or SHARED is
exact, as for the FlashAttention adapters alone).
"""

from __future__ import annotations

import math

import torch

from rlt.attention.backend import AttentionBackend, BackendSpec, forward_with_new_kv
from rlt.attention.kv_cache import KVCache
from rlt.attention.metadata import AttentionMetadata


def _both(a: frozenset | None, b: frozenset | None) -> frozenset | None:
    if a is None:
        return b
    return a if b is None else a & b


def combined_spec(prefill: BackendSpec, decode: BackendSpec) -> BackendSpec:
    return BackendSpec(
        dtypes=_both(prefill.dtypes, decode.dtypes),
        head_dims=_both(prefill.head_dims, decode.head_dims),
        block_size_multiple=math.lcm(prefill.block_size_multiple, decode.block_size_multiple),
        packed_prefill=prefill.packed_prefill,
        graph_safe=decode.graph_safe,  # graphs capture decode-only steps, which never reach `prefill`
        depth_indirection=prefill.depth_indirection and decode.depth_indirection,
        flat_slot_kv_write=decode.flat_slot_kv_write,  # write_kv is the decode backend's
    )


class PrefillDecodeBackend(AttentionBackend):
    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        super().__init__()
        self.prefill = prefill
        self.decode = decode
        self.name = f"{prefill.name}+{decode.name}"
        self.spec = combined_spec(prefill.spec, decode.spec)

    def prepare(self, kv: KVCache, meta: AttentionMetadata) -> AttentionMetadata:
        return (self.prefill if meta.max_query_len > 1 else self.decode).prepare(kv, meta)

    def write_kv(self, kv: KVCache, layer: int, key: torch.Tensor, value: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        self.decode.write_kv(kv, layer, key, value, meta)

    @property
    def takes_new_kv(self) -> bool:
        return self.prefill.takes_new_kv or self.decode.takes_new_kv

    def forward(self, query: torch.Tensor, kv: KVCache, layer: int, meta: AttentionMetadata,
                scale: float, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        backend = self.prefill if meta.max_query_len > 1 else self.decode
        return forward_with_new_kv(backend, query, kv, layer, meta, scale, new_kv)

    def describe(self) -> str:
        return f"{self.prefill.describe()} for steps with prompt chunks, {self.decode.describe()} for decode-only steps"
