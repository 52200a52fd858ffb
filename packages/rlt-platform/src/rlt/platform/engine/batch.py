"""The base batch builder: row order, packed token metadata and attention metadata of a step.

Rows are ordered in three groups so the executor can assemble its input without per-row work:
depth-0 rows first (their input is the embedding of their tokens), then deeper one-token decode
rows (input from the executor's hidden-state slot table), then deeper prompt rows of any length
(prompt chunks, whose hidden states the executor keeps per chunk, keyed by slot and first
position — so a request may own several prompt rows of one step). Index arithmetic is numpy over the rows; the
arrays go to the device in one upload through the :class:`Uploader`.
"""

from __future__ import annotations

import itertools

from typing import Sequence

import attrs
import numpy as np
import torch

from rlt.attention import AttentionMetadata, KVLayout
from rlt.platform.engine.exit_policy import row_thresholds
from rlt.platform.engine.interfaces import Row
from rlt.platform.engine.prompt_logprobs import Jobs, prompt_logprob_jobs


@attrs.frozen(eq=False)
class StepBatch:
    rows: tuple[Row, ...]  # batch order
    slots: np.ndarray  # [R] host, in row order
    slots_device: torch.Tensor  # the same, on the device
    depth: np.ndarray  # [R] 0-based loop each row runs
    num_depth0: int  # rows [0, num_depth0) start from embeddings
    num_single: int  # rows [num_depth0, num_depth0 + num_single) are deeper one-token decode rows
    embed_token_ids: torch.Tensor  # [tokens of depth-0 rows]
    meta: AttentionMetadata
    row_last_token: torch.Tensor  # [R] index of each row's last token in the packed axis
    row_token_start: np.ndarray  # [R] host
    row_start: np.ndarray  # [R] host, first position of each row
    row_len: np.ndarray  # [R] host
    in_prompt: np.ndarray  # [R] host
    fixed_exit: np.ndarray  # [R] rows whose exit is known without the gate (loop == max_loops)
    adaptive: np.ndarray  # [R] rows that consult the gate
    samples: np.ndarray  # [R] rows that produce a token when they exit
    loop: torch.Tensor  # [R] int32, 1-based loop count after this step
    min_loops: torch.Tensor
    max_loops: torch.Tensor
    threshold: torch.Tensor  # τ per row; exit_policy.NEVER for rows that do not consult the gate
    prompt_logprobs: Jobs = attrs.field(factory=dict)  # prompt rows that want prompt logprobs, by row index

    @property
    def num_rows(self) -> int:
        return len(self.slots)

    @property
    def has_prompt_rows(self) -> bool:
        return bool(self.in_prompt.any())


def _column(rows: Sequence[Row], name: str, dtype) -> np.ndarray:
    return np.fromiter((getattr(r, name) for r in rows), dtype, len(rows))


def row_block_tables(rows: Sequence[Row], slots: np.ndarray, tables: np.ndarray) -> np.ndarray:
    """Each row's page table ``[R, planes, pages]``: its slot's, or its own for a row type with
    ``Row.own_pages``."""
    out = tables[slots]
    for i, r in enumerate(rows):
        if r.own_pages:
            out[i] = r.block_table(tables)
    return out


class RowBatchBuilder:
    def __init__(self, *, kv, slots, uploader, layout: KVLayout) -> None:
        self.kv = kv
        self.slots = slots
        self.uploader = uploader
        self.layout = layout

    @classmethod
    def from_context(cls, ctx) -> "RowBatchBuilder":
        p = ctx.parts
        return cls(kv=p.kv_manager, slots=p.slots, uploader=p.uploader, layout=ctx.kv.layout)

    def build(self, rows_in: Sequence[Row]) -> StepBatch:
        depth_in = _column(rows_in, "depth", np.int64)
        len_in = _column(rows_in, "length", np.int64)
        group = np.where(depth_in == 0, 0, np.where((len_in == 1) & ~_column(rows_in, "in_prompt", bool), 1, 2))
        order = np.argsort(group, kind="stable")
        rows = tuple(rows_in[i] for i in order)
        slots = _column(rows, "slot", np.int64)
        depth = depth_in[order]
        lens = len_in[order]
        starts = _column(rows, "start", np.int64)
        in_prompt = _column(rows, "in_prompt", bool)
        samples = _column(rows, "samples", bool)
        num_depth0 = int((group == 0).sum())
        num_single = int((group == 1).sum())

        # Tokens of depth-0 rows (decode rows: the token sampled last; prompt rows: their slice).
        pieces = [r.token_ids() for r in rows[:num_depth0]]
        embed_ids = np.fromiter(itertools.chain.from_iterable(pieces), np.int64, sum(map(len, pieces)))

        cu = np.zeros(len(slots) + 1, np.int64)
        np.cumsum(lens, out=cu[1:])
        n = int(cu[-1])
        tok_row = np.repeat(np.arange(len(slots)), lens)
        tok_pos = starts[tok_row] + (np.arange(n) - cu[tok_row])
        bs = self.kv.block_size
        page, off = tok_pos // bs, tok_pos % bs
        plane = np.zeros_like(depth) if self.layout is KVLayout.SHARED else depth
        row_tables = row_block_tables(rows, slots, self.kv.block_tables)
        slot_mapping = row_tables[tok_row, plane[tok_row], page].astype(np.int64) * bs + off
        plane0 = row_tables[tok_row, 0, page].astype(np.int64) * bs + off
        seq_lens = starts + lens

        t = self.slots
        loop = depth + 1
        max_loops = t.max_loops[slots].astype(np.int64)
        adaptive = (~in_prompt) & t.adaptive[slots]
        fixed_exit = loop >= max_loops

        dev = self.uploader.upload({
            "query_start_loc": cu.astype(np.int32), "seq_lens": seq_lens.astype(np.int32),
            "query_depth": depth.astype(np.int32), "block_tables": row_tables,
            "slot_mapping": slot_mapping, "plane0": plane0, "token_query_depth": depth[tok_row].astype(np.int32),
            "positions": tok_pos.astype(np.int64), "embed_ids": embed_ids,
            "row_last_token": (cu[1:] - 1).astype(np.int64), "slots": slots,
            "loop": loop.astype(np.int32), "min_loops": t.min_loops[slots].astype(np.int32),
            "max_loops": max_loops.astype(np.int32), "threshold": row_thresholds(t.threshold[slots], adaptive),
        })
        meta = AttentionMetadata(
            query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"],
            query_depth=dev["query_depth"],
            block_tables=dev["block_tables"],
            slot_mapping=dev["slot_mapping"],
            plane0_slot_mapping=dev["plane0"],
            token_query_depth=dev["token_query_depth"],
            positions=dev["positions"],
            max_query_len=int(lens.max()) if len(lens) else 0,
            max_seq_len=int(seq_lens.max()) if len(seq_lens) else 0,
            layout=self.layout,
            fresh=bool(len(starts)) and not starts.any(),
        )
        return StepBatch(
            rows=rows, slots=slots, depth=depth, num_depth0=num_depth0, num_single=num_single,
            embed_token_ids=dev["embed_ids"], meta=meta, slots_device=dev["slots"],
            row_last_token=dev["row_last_token"], row_token_start=cu[:-1], row_start=starts, row_len=lens,
            in_prompt=in_prompt, fixed_exit=fixed_exit, adaptive=adaptive, samples=samples,
            loop=dev["loop"], min_loops=dev["min_loops"], max_loops=dev["max_loops"], threshold=dev["threshold"],
            prompt_logprobs=prompt_logprob_jobs(rows),
        )
