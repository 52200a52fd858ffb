"""Dense gather of each row's context from the paged pool (used by the eager backends).

Builds, without Python loops over rows, the padded key/value tensors ``[R, max_seq, kv_heads, d]``
that each row attends to, resolving the depth plane per key (``min(query depth, token_depth)``
for LAST_EXITED, plane 0 for SHARED), plus the padded query index and the causal mask. The GPU
kernels do the same addressing inside the kernel; this is the readable statement of it.
"""

from __future__ import annotations

import attrs
import torch

from rlt.attention.kv_cache import KVCache, KVLayout
from rlt.attention.metadata import AttentionMetadata


@attrs.frozen(eq=False)
class DenseContext:
    key: torch.Tensor  # [R, C, kv_heads, d]
    value: torch.Tensor  # [R, C, kv_heads, d]
    query_index: torch.Tensor  # [R, Q] index into the packed token axis (clamped)
    query_valid: torch.Tensor  # [R, Q] bool
    allowed: torch.Tensor  # [R, Q, C] bool, causal & in-range


def key_slots(kv: KVCache, meta: AttentionMetadata, max_seq: int) -> torch.Tensor:
    """Flat slot of key position j for every row: ``[R, max_seq]`` int64."""
    device = meta.seq_lens.device
    bs = kv.block_size
    pos = torch.arange(max_seq, device=device)
    page = (pos // bs).clamp_max(meta.block_tables.shape[2] - 1)
    offset = pos % bs
    tables = meta.block_tables.long()
    plane0 = tables[:, 0, :].gather(1, page.expand(tables.shape[0], -1))  # [R, C]
    if kv.layout is KVLayout.SHARED or kv.token_depth is None:
        return plane0 * bs + offset
    stamped = kv.token_depth.view(-1)[plane0 * bs + offset].long()
    plane = torch.minimum(stamped, meta.query_depth.long()[:, None]).clamp(0, kv.num_planes - 1)
    idx = plane * tables.shape[2] + page  # index into flattened [planes * max_pages]
    block = tables.reshape(tables.shape[0], -1).gather(1, idx)
    return block * bs + offset


def gather_context(kv: KVCache, layer: int, meta: AttentionMetadata) -> DenseContext:
    device = meta.seq_lens.device
    qsl = meta.query_start_loc.long()
    qlen = qsl[1:] - qsl[:-1]
    seq = meta.seq_lens.long()
    max_q, max_c = meta.max_query_len, meta.max_seq_len
    slots = key_slots(kv, meta, max_c)
    nkv, d = kv.k.shape[3], kv.k.shape[4]
    key = kv.k[layer].view(-1, nkv, d)[slots]
    value = kv.v[layer].view(-1, nkv, d)[slots]
    qi = torch.arange(max_q, device=device)
    query_valid = qi[None, :] < qlen[:, None]
    query_index = (qsl[:-1, None] + qi[None, :]).clamp_max(max(meta.num_tokens - 1, 0))
    q_pos = seq[:, None] - qlen[:, None] + qi[None, :]  # [R, Q]
    k_pos = torch.arange(max_c, device=device)
    allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < seq[:, None, None])
    allowed &= query_valid[:, :, None]
    return DenseContext(key, value, query_index, query_valid, allowed)


def scatter_rows(padded: torch.Tensor, ctx: DenseContext, num_tokens: int) -> torch.Tensor:
    """Inverse of the query padding: ``[R, Q, ...]`` -> ``[N, ...]``."""
    out = padded.new_empty((num_tokens, *padded.shape[2:]))
    out[ctx.query_index[ctx.query_valid]] = padded[ctx.query_valid]
    return out
