"""FlashAttention for prompt rows under adaptive exit: attention dispatched per row group.

Why it is exact. A prompt row reads only KV of prompt positions, and prompt positions always run
every loop of their request (the exit gate is never consulted for them); chunked and wavefront
prefill start (c, d) only after (c - 1, d) wrote plane d. So for a prompt row at depth d every
key exists on plane d, and LAST_EXITED's per-key lookup ``min(d, token_depth[j])`` is plane d
itself — which is what FlashAttention reads (one page table per row, the row's own plane). Decode
rows may read keys that exited shallower, so they stay with a depth-indirecting backend (Triton).

:class:`PromptRowGroups` splits a step's rows into the two groups once per step (``prepare``):
each group gets its own :class:`~rlt.attention.AttentionMetadata` (rows and tokens selected on the
device with index tensors uploaded by the batch builder, host bounds computed on the host), and
every layer runs the prompt backend on the prompt rows and the other backend on the rest. A step
of only prompt rows (a long prefill) or only decode rows goes to one backend whole, with no
gather and no extra upload. K/V are written once, over the whole step, by the other backend's writer.

:class:`RowGroupBatchBuilder` (a batch-builder wrapper) adds the grouping to the step's metadata
(:class:`RowGroupMetadata`); nothing else changes. :class:`PlaneLocalTorchBackend` is
FlashAttention's semantics in Torch (each row reads its own plane only): the CPU stand-in with
which the tests prove the dispatch exact, and show that the same backend on decode rows is not.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import numpy as np
import torch

from rlt.attention import AttentionBackend, AttentionMetadata, KVCache, KVLayout
from rlt.attention.backend import forward_with_new_kv
from rlt.attention.backends.flash import row_plane_page_table
from rlt.attention.backends.torch_ref import TorchReferenceBackend
from rlt.platform.engine.interfaces import Row, Wrapped


@attrs.frozen(eq=False)
class RowGroups:
    """The step's rows split into prompt rows and the others (device index tensors, host bounds)."""

    prompt_rows: torch.Tensor  # [Rp] int64 row indices
    prompt_tokens: torch.Tensor  # [Np] int64 packed-token indices
    prompt_qsl: torch.Tensor  # [Rp + 1] int32
    prompt_max_query_len: int
    prompt_max_seq_len: int
    other_rows: torch.Tensor
    other_tokens: torch.Tensor
    other_qsl: torch.Tensor
    other_max_query_len: int
    other_max_seq_len: int
    #: host: every prompt row starts at position 0 (AttentionMetadata.fresh); the other rows are decode rows,
    #: never fresh
    prompt_fresh: bool = False

    @property
    def num_prompt_rows(self) -> int:
        return self.prompt_rows.shape[0]

    @property
    def num_other_rows(self) -> int:
        return self.other_rows.shape[0]


@attrs.frozen(eq=False)
class RowGroupMetadata(AttentionMetadata):
    #: the split of a mixed step (None when every row is a prompt row)
    groups: RowGroups | None = None
    #: set by ``PromptRowGroups.prepare``: (prompt metadata, other metadata), each None when empty
    parts: tuple[AttentionMetadata | None, AttentionMetadata | None] | None = None


def _group(lens: np.ndarray, seq: np.ndarray, cu: np.ndarray, sel: np.ndarray) -> dict[str, Any]:
    rows = np.nonzero(sel)[0]
    glen = lens[rows]
    qsl = np.zeros(len(rows) + 1, np.int32)
    np.cumsum(glen, out=qsl[1:])
    n = int(qsl[-1])
    row_of = np.repeat(np.arange(len(rows)), glen)
    tokens = cu[rows][row_of] + (np.arange(n) - qsl[:-1][row_of])
    return {"rows": rows.astype(np.int64), "tokens": tokens.astype(np.int64), "qsl": qsl,
            "max_q": int(glen.max()) if len(glen) else 0, "max_s": int(seq[rows].max()) if len(rows) else 0,
            "fresh": bool(len(rows)) and bool((seq[rows] == glen).all())}


def row_groups(rows: Sequence[Row], uploader) -> RowGroups:
    """Split rows (batch order) into prompt rows and the rest: one upload of the index arrays."""
    lens = np.fromiter((r.length for r in rows), np.int64, len(rows))
    seq = np.fromiter((r.end for r in rows), np.int64, len(rows))
    prompt = np.fromiter((r.in_prompt for r in rows), bool, len(rows))
    cu = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(lens, out=cu[1:])
    p, o = _group(lens, seq, cu[:-1], prompt), _group(lens, seq, cu[:-1], ~prompt)
    dev = uploader.upload({"p_rows": p["rows"], "p_tokens": p["tokens"], "p_qsl": p["qsl"],
                           "o_rows": o["rows"], "o_tokens": o["tokens"], "o_qsl": o["qsl"]})
    return RowGroups(dev["p_rows"], dev["p_tokens"], dev["p_qsl"], p["max_q"], p["max_s"],
                     dev["o_rows"], dev["o_tokens"], dev["o_qsl"], o["max_q"], o["max_s"], p["fresh"])


def select_rows(meta: AttentionMetadata, rows: torch.Tensor, tokens: torch.Tensor, qsl: torch.Tensor,
                max_query_len: int, max_seq_len: int, fresh: bool = False) -> AttentionMetadata:
    """The metadata of a subset of a step's rows (device gathers; no host sync)."""
    return AttentionMetadata(
        query_start_loc=qsl, seq_lens=meta.seq_lens.index_select(0, rows),
        query_depth=meta.query_depth.index_select(0, rows), block_tables=meta.block_tables.index_select(0, rows),
        slot_mapping=meta.slot_mapping.index_select(0, tokens),
        plane0_slot_mapping=meta.plane0_slot_mapping.index_select(0, tokens),
        token_query_depth=meta.token_query_depth.index_select(0, tokens),
        positions=meta.positions.index_select(0, tokens),
        max_query_len=max_query_len, max_seq_len=max_seq_len, layout=meta.layout, fresh=fresh,
    )


class RowGroupBatchBuilder(Wrapped):
    """Batch-builder wrapper: the step's metadata carries its prompt / other row groups."""

    def __init__(self, inner, uploader) -> None:
        super().__init__(inner)
        self.uploader = uploader

    def build(self, rows: Sequence[Row]):
        batch = self.inner.build(rows)
        prompt = np.fromiter((r.in_prompt for r in batch.rows), bool, len(batch.rows))
        if not prompt.any():
            return batch  # decode-only step: plain metadata, nothing more uploaded (graph-replay friendly)
        meta = batch.meta
        fields = {f.name: getattr(meta, f.name) for f in attrs.fields(AttentionMetadata)}
        groups = None if prompt.all() else row_groups(batch.rows, self.uploader)
        return attrs.evolve(batch, meta=RowGroupMetadata(**fields, groups=groups))


class PromptRowGroups(AttentionBackend):
    """``prompt`` backend (FlashAttention) for prompt rows, ``other`` (Triton) for the rest."""

    def __init__(self, prompt: AttentionBackend, other: AttentionBackend) -> None:
        super().__init__()
        self.prompt = prompt
        self.other = other
        self.name = f"{prompt.name}[prompt rows]+{other.name}"
        # Prompt rows never need depth indirection (module docstring): the pair is as exact as `other`.
        self.spec = other.spec

    def describe(self) -> str:
        return f"{self.prompt.describe()} for prompt rows, {self.other.describe()} for decode rows (per row group)"

    def prepare(self, kv: KVCache, meta: AttentionMetadata) -> AttentionMetadata:
        if not isinstance(meta, RowGroupMetadata):  # no prompt rows in this step
            return self.other.prepare(kv, meta)
        g = meta.groups
        if g is None:  # only prompt rows (a long prefill): the prompt backend takes the step whole
            return attrs.evolve(meta, parts=(self.prompt.prepare(kv, meta), None))
        pm = select_rows(meta, g.prompt_rows, g.prompt_tokens, g.prompt_qsl, g.prompt_max_query_len,
                         g.prompt_max_seq_len, g.prompt_fresh)
        om = select_rows(meta, g.other_rows, g.other_tokens, g.other_qsl, g.other_max_query_len, g.other_max_seq_len)
        return attrs.evolve(meta, parts=(self.prompt.prepare(kv, pm), self.other.prepare(kv, om)))

    def write_kv(self, kv: KVCache, layer: int, key: torch.Tensor, value: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        self.other.write_kv(kv, layer, key, value, meta)

    @property
    def takes_new_kv(self) -> bool:
        # Only prompt rows can start at position 0 (be fresh); the others are decode rows, never handed K/V.
        return self.prompt.takes_new_kv

    def forward(self, query: torch.Tensor, kv: KVCache, layer: int, meta: AttentionMetadata,
                scale: float, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        parts = getattr(meta, "parts", None)
        if parts is None:  # no prompt rows in this step
            return self.other.forward(query, kv, layer, meta, scale)
        pm, om = parts
        if om is None:
            return forward_with_new_kv(self.prompt, query, kv, layer, pm, scale, new_kv)
        g = meta.groups
        n, nh, d = query.shape
        out = query.new_empty((n, nh * d))
        prompt_kv = None if new_kv is None or not pm.fresh else \
            (new_kv[0].index_select(0, g.prompt_tokens), new_kv[1].index_select(0, g.prompt_tokens))
        out.index_copy_(0, g.prompt_tokens, forward_with_new_kv(self.prompt, query.index_select(0, g.prompt_tokens),
                                                                kv, layer, pm, scale, prompt_kv))
        out.index_copy_(0, g.other_tokens, self.other.forward(query.index_select(0, g.other_tokens), kv, layer,
                                                              om, scale))
        return out


class PlaneLocalTorchBackend(TorchReferenceBackend):
    """FlashAttention's LAST_EXITED semantics in Torch: every row reads its own plane only."""

    name = "torch_plane_local"

    def forward(self, query: torch.Tensor, kv: KVCache, layer: int, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        if kv.layout is KVLayout.LAST_EXITED:
            meta = attrs.evolve(meta, block_tables=row_plane_page_table(kv, meta)[:, None, :])
            kv = attrs.evolve(kv, layout=KVLayout.SHARED)
        return super().forward(query, kv, layer, meta, scale)
