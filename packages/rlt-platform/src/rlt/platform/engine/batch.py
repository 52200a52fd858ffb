"""Build one step's batch: row order, packed token metadata and attention metadata.

Rows are ordered in three groups so the executor can assemble its input without per-row work:
depth-0 rows first (their input is the embedding of their tokens), then deeper one-token rows
(input from the executor's hidden-state slot table), then deeper multi-token rows (prompt chunks,
whose hidden states the executor keeps per slot). All index arithmetic is numpy over the rows.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from rlt.attention import AttentionMetadata, KVLayout
from rlt.platform.engine.prompt_logprobs import Jobs, prompt_logprob_jobs
from rlt.platform.engine.slots import SlotTable
from rlt.platform.engine.staging import Staging
from rlt.platform.kv import KVPool


@attrs.frozen(eq=False)
class StepBatch:
    slots: np.ndarray  # [R] host, in row order
    slots_device: torch.Tensor  # the same, on the device
    depth: np.ndarray  # [R] 0-based loop each row runs
    num_depth0: int  # rows [0, num_depth0) start from embeddings
    num_single: int  # rows [num_depth0, num_depth0 + num_single) are deeper one-token rows
    embed_token_ids: torch.Tensor  # [tokens of depth-0 rows]
    meta: AttentionMetadata
    row_last_token: torch.Tensor  # [R] index of each row's last token in the packed axis
    row_token_start: np.ndarray  # [R] host
    row_len: np.ndarray  # [R] host
    fixed_exit: np.ndarray  # [R] rows whose exit is known without the gate (loop == max_loops)
    adaptive: np.ndarray  # [R] rows that consult the gate
    samples: np.ndarray  # [R] rows that produce a token when they exit
    loop: torch.Tensor  # [R] int32, 1-based loop count after this step
    min_loops: torch.Tensor
    max_loops: torch.Tensor
    threshold: torch.Tensor  # τ, set to 2.0 for non-adaptive rows
    prompt_logprobs: Jobs = attrs.field(factory=dict)  # prompt chunks that want prompt logprobs, by slot

    @property
    def num_rows(self) -> int:
        return len(self.slots)


def build_step_batch(requests, table: SlotTable, pool: KVPool, staging: Staging) -> StepBatch:
    slots_in = np.fromiter((r.slot for r in requests), np.int64, len(requests))
    depth_in = table.depth[slots_in]
    len_in = table.chunk_len[slots_in]
    group = np.where(depth_in == 0, 0, np.where(len_in == 1, 1, 2))
    order = np.argsort(group, kind="stable")
    slots = slots_in[order]
    depth = depth_in[order].astype(np.int64)
    lens = len_in[order]
    starts = table.chunk_start[slots]
    num_depth0 = int((group == 0).sum())
    num_single = int((group == 1).sum())

    # Tokens of depth-0 rows (decode rows: the token sampled last; prompt rows: their slice).
    ordered_reqs = [requests[i] for i in order[:num_depth0]]
    pieces = [r.all_token_ids[r.chunk_start:r.chunk_start + r.chunk_len] for r in ordered_reqs]
    embed_ids = np.fromiter((t for p in pieces for t in p), np.int64)

    cu = np.zeros(len(slots) + 1, np.int64)
    np.cumsum(lens, out=cu[1:])
    n = int(cu[-1])
    tok_row = np.repeat(np.arange(len(slots)), lens)
    tok_pos = starts[tok_row] + (np.arange(n) - cu[tok_row])
    bs = pool.block_size
    page, off = tok_pos // bs, tok_pos % bs
    plane = np.zeros_like(depth) if pool.layout is KVLayout.SHARED else depth
    tables = pool.block_tables
    slot_mapping = tables[slots[tok_row], plane[tok_row], page].astype(np.int64) * bs + off
    plane0 = tables[slots[tok_row], 0, page].astype(np.int64) * bs + off
    seq_lens = starts + lens

    loop = depth + 1
    max_loops = table.max_loops[slots].astype(np.int64)
    in_prompt = table.in_prompt[slots]
    adaptive = (~in_prompt) & (table.threshold[slots] < 1.0)
    fixed_exit = loop >= max_loops
    threshold = np.where(adaptive, table.threshold[slots], 2.0).astype(np.float32)

    dev = staging.upload({
        "query_start_loc": cu.astype(np.int32), "seq_lens": seq_lens.astype(np.int32),
        "query_depth": depth.astype(np.int32), "block_tables": pool.block_tables[slots],
        "slot_mapping": slot_mapping, "plane0": plane0, "token_query_depth": depth[tok_row].astype(np.int32),
        "positions": tok_pos.astype(np.int64), "embed_ids": embed_ids, "row_last_token": (cu[1:] - 1).astype(np.int64),
        "slots": slots.astype(np.int64), "loop": loop.astype(np.int32),
        "min_loops": table.min_loops[slots].astype(np.int32), "max_loops": max_loops.astype(np.int32),
        "threshold": threshold,
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
        layout=pool.layout,
    )
    return StepBatch(
        slots=slots, depth=depth, num_depth0=num_depth0, num_single=num_single,
        embed_token_ids=dev["embed_ids"], meta=meta, slots_device=dev["slots"],
        row_last_token=dev["row_last_token"], row_token_start=cu[:-1], row_len=lens,
        fixed_exit=fixed_exit, adaptive=adaptive, samples=table.samples[slots],
        loop=dev["loop"], min_loops=dev["min_loops"], max_loops=dev["max_loops"], threshold=dev["threshold"],
        prompt_logprobs=prompt_logprob_jobs(requests),
    )
