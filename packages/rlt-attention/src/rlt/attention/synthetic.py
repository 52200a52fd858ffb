"""Random paged-KV attention problems, for kernel tests and micro-benchmarks.

:func:`random_problem` builds a :class:`KVCache`, the :class:`AttentionMetadata` of one step and a
query, for rows given as (context length including the new tokens, new tokens, depth). Every
plane of every row gets its own randomly placed blocks and the whole cache is random, so a kernel
that reads the wrong plane, page or slot produces a visibly wrong result. Under LAST_EXITED the
history tokens carry random exit depths (``history="mixed"``) or the deepest plane
(``history="full"``: fixed-depth serving), and the running chunk is stamped with its row's depth,
as the executor does before a step's layers run.

This module only builds inputs; it never decides what a kernel should compute (the Torch
reference backend does).
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from rlt.attention.kv_cache import KVCache, KVLayout
from rlt.attention.metadata import AttentionMetadata


@attrs.frozen(eq=False)
class Problem:
    query: torch.Tensor  # [N, heads, d]
    kv: KVCache
    meta: AttentionMetadata
    layer: int
    scale: float


def random_problem(
    rows: Sequence[tuple[int, int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_planes: int,
    layout: KVLayout = KVLayout.LAST_EXITED,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    num_layers: int = 1,
    layer: int = 0,
    history: str = "mixed",
    spare_blocks: int = 3,
    seed: int = 0,
) -> Problem:
    if history not in ("mixed", "full"):
        raise ValueError(f"history must be 'mixed' or 'full', got {history!r}")
    gen = torch.Generator().manual_seed(seed)
    shared = layout is KVLayout.SHARED
    planes = 1 if shared else num_planes
    ctx = torch.tensor([r[0] for r in rows], dtype=torch.int64)
    qlen = torch.tensor([r[1] for r in rows], dtype=torch.int64)
    depth = torch.tensor([r[2] for r in rows], dtype=torch.int64)
    if bool((qlen > ctx).any()) or bool((depth >= num_planes).any()) or bool((depth < 0).any()):
        raise ValueError("each row needs query_len <= context_len and 0 <= depth < num_planes")
    pages = (ctx + block_size - 1) // block_size
    max_pages = int(pages.max()) + 1 if len(rows) else 1
    used = int(pages.sum()) * planes
    num_blocks = used + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(rows), planes, max_pages), generator=gen, dtype=torch.int64)
    cursor = 0
    for r, p in enumerate(pages.tolist()):
        for plane in range(planes):
            tables[r, plane, :p] = perm[cursor:cursor + p]
            cursor += p

    dev = torch.device(device)
    dgen = torch.Generator(device=dev).manual_seed(seed + 1)
    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=dgen, device=dev, dtype=dtype)
    v = torch.randn(shape, generator=dgen, device=dev, dtype=dtype)
    token_depth = None
    if not shared:
        token_depth = torch.randint(0, num_planes, (num_blocks, block_size), generator=gen, dtype=torch.int32)

    cu = torch.zeros(len(rows) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(qlen, 0)
    n = int(cu[-1])
    tok_row = torch.repeat_interleave(torch.arange(len(rows)), qlen)
    tok_pos = (ctx - qlen)[tok_row] + (torch.arange(n) - cu[tok_row])
    page, off = tok_pos // block_size, tok_pos % block_size
    plane = torch.zeros_like(depth) if shared else depth
    slot_mapping = tables[tok_row, plane[tok_row], page] * block_size + off
    plane0 = tables[tok_row, 0, page] * block_size + off
    if token_depth is not None:
        flat = token_depth.view(-1)
        for r, (c, q, _) in enumerate(rows):
            hist = torch.arange(c - q)
            hist_slots = tables[r, 0, hist // block_size] * block_size + hist % block_size
            if history == "full":
                flat[hist_slots] = num_planes - 1
            else:
                flat[hist_slots] = torch.randint(0, num_planes, (len(hist),), generator=gen, dtype=torch.int32)
        flat[plane0] = depth[tok_row].to(torch.int32)

    query = torch.randn((n, num_heads, head_dim), generator=dgen, device=dev, dtype=dtype)
    kv = KVCache(k=k, v=v, token_depth=None if token_depth is None else token_depth.to(dev),
                 layout=layout, num_planes=planes)
    meta = AttentionMetadata(
        query_start_loc=cu.to(dev, torch.int32),
        seq_lens=ctx.to(dev, torch.int32),
        query_depth=depth.to(dev, torch.int32),
        block_tables=tables.to(dev, torch.int32),
        slot_mapping=slot_mapping.to(dev),
        plane0_slot_mapping=plane0.to(dev),
        token_query_depth=depth[tok_row].to(dev, torch.int32),
        positions=tok_pos.to(dev),
        max_query_len=int(qlen.max()) if len(rows) else 0,
        max_seq_len=int(ctx.max()) if len(rows) else 0,
        layout=layout,
        fresh=bool(len(rows)) and bool((ctx == qlen).all()),
    )
    return Problem(query=query, kv=kv, meta=meta, layer=layer, scale=head_dim ** -0.5)
