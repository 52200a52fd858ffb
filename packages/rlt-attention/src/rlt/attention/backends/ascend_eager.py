"""``ascend_eager``: attention in the Hugging Face eager rounding order, paged KV via ScatterND.

Rounding order (all in the model dtype unless stated), as HF's ``eager_attention_forward``:
scores = q @ kᵀ (rounded), then × d^-1/2 (rounded again), + additive mask (dtype min), softmax in
fp32 then cast to the model dtype, then probs @ v (rounded). The KV write is an indexed row update:
``torch_npu.npu_scatter_nd_update_`` on Ascend (passed in by the platform), ``index_copy_`` elsewhere.

The math is device-independent and runs on CPU, which is how it is tested without an NPU.
"""

from __future__ import annotations

import torch

from rlt.attention.backend import AttentionBackend, BackendSpec
from rlt.attention.gather import gather_context, scatter_rows
from rlt.attention.kv_cache import KVCache, RowScatter
from rlt.attention.metadata import AttentionMetadata


def npu_scatter_nd(torch_npu_module) -> RowScatter:
    """Adapt ``torch_npu.npu_scatter_nd_update_(x, indices[N,1], updates)`` to a row scatter."""

    def scatter(dst2d: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
        torch_npu_module.npu_scatter_nd_update_(dst2d, index.view(-1, 1), rows)

    return scatter


class AscendEagerBackend(AttentionBackend):
    name = "ascend_eager"
    spec = BackendSpec(flat_slot_kv_write=False)  # stores through ScatterND, synchronised (ARCHITECTURE §2)

    def forward(
        self, query: torch.Tensor, kv: KVCache, layer: int, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        n, nh, d = query.shape
        dtype = query.dtype
        ctx = gather_context(kv, layer, meta)
        nkv = ctx.key.shape[2]
        q = query[ctx.query_index].transpose(1, 2)  # [R, nh, Q, d]
        k = ctx.key.repeat_interleave(nh // nkv, dim=2).transpose(1, 2).to(dtype)  # [R, nh, C, d]
        v = ctx.value.repeat_interleave(nh // nkv, dim=2).transpose(1, 2).to(dtype)
        scores = torch.matmul(q, k.transpose(2, 3))
        scores = scores * scale
        mask = torch.zeros(ctx.allowed.shape, dtype=dtype, device=query.device)
        mask = mask.masked_fill(~ctx.allowed, torch.finfo(dtype).min)
        scores = scores + mask[:, None]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
        out = torch.matmul(probs, v).transpose(1, 2)  # [R, Q, nh, d]
        return scatter_rows(out, ctx, n).reshape(n, nh * d)
