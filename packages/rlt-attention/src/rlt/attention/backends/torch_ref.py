"""The Torch reference backend: fp32 softmax attention over gathered paged KV, any device.

It is the semantic definition every other backend is tested against: scores, softmax and the
value product are computed in float32 and the result is cast back to the query dtype.
"""

from __future__ import annotations

import torch

from rlt.attention.backend import AttentionBackend, BackendSpec
from rlt.attention.gather import gather_context, scatter_rows
from rlt.attention.kv_cache import KVCache
from rlt.attention.metadata import AttentionMetadata


class TorchReferenceBackend(AttentionBackend):
    name = "torch"
    spec = BackendSpec()

    def forward(
        self, query: torch.Tensor, kv: KVCache, layer: int, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        n, nh, d = query.shape
        ctx = gather_context(kv, layer, meta)
        nkv = ctx.key.shape[2]
        q = query[ctx.query_index].float()  # [R, Q, nh, d]
        k = ctx.key.float().repeat_interleave(nh // nkv, dim=2)  # [R, C, nh, d]
        v = ctx.value.float().repeat_interleave(nh // nkv, dim=2)
        scores = torch.einsum("rqhd,rchd->rhqc", q, k) * scale
        scores = scores.masked_fill(~ctx.allowed[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out = torch.einsum("rhqc,rchd->rqhd", probs, v).to(query.dtype)
        return scatter_rows(out, ctx, n).reshape(n, nh * d)
