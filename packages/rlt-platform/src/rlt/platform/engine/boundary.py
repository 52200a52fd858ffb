"""The executor of models with boundary attention (Huginn): prelude and coda blocks run attention.

It follows the executor contract of :mod:`rlt.platform.models.huginn`, over the base engine's rows
and batches (so Continuous Depth Batching, arrivals between steps and per-request depth work as
for Ouro):

* depth-0 rows (a prompt chunk or a decoded token entering the loop) run the prelude on the
  boundary KV and start from ``initial_state`` (seeded by the request's ``seed`` and token
  position, scaled by its ``init_state_scale``); the prelude output is the rows' **injection**,
  kept per slot (one-token rows) or per chunk, like the recurrent state, until the row exits;
* every row runs one recurrence per step (``recurrent(state, injection)``) on the per-depth core
  KV; there is no exit gate: a row exits at its request's ``max_loops`` (its recurrence count);
* exited rows run the coda over all their tokens (its KV is read by later positions), then the
  head on the last token of the rows that sample.

The boundary cache has one plane; block b is paired with block b of the core pool and addressed
through the core page tables' plane 0 (see :mod:`rlt.platform.engine.context`), so it needs no
allocator of its own. The boundary metadata of a set of rows is gathered on the device from the
step's metadata. Prompt logprobs are not served (their LM head needs the coda over the prompt).
"""

from __future__ import annotations

import numpy as np
import torch

from rlt.attention import AttentionMetadata, KVLayout
from rlt.platform.engine.batch import StepBatch
from rlt.platform.engine.executor import (
    CompletedStep,
    EagerExecutor,
    gather_row_state,
    keep_row_state,
    sample_exited,
)


def _token_index(b: StepBatch, rows: np.ndarray) -> np.ndarray:
    """Packed-token indices of ``rows`` (row after row)."""
    if len(rows) == 0:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(s, s + n) for s, n in zip(b.row_token_start[rows], b.row_len[rows])])


class BoundaryExecutor(EagerExecutor):
    supports_prompt_logprobs = False

    def __init__(self, *, boundary_kv, **kw) -> None:
        super().__init__(**kw)
        self.boundary_kv = boundary_kv
        #: the injection (prelude output) of one-token rows by slot, and of chunks by (slot, start)
        self.injection = torch.zeros_like(self.hidden)
        self.chunk_injection: dict[tuple[int, int], torch.Tensor] = {}

    @classmethod
    def from_context(cls, ctx) -> "BoundaryExecutor":
        return cls(model=ctx.model, kv=ctx.cache, boundary_kv=ctx.boundary_cache, attention=ctx.attention,
                   sampler=ctx.parts.sampler, max_num_seqs=ctx.max_num_seqs, device=ctx.device)

    def release(self, slot: int) -> None:
        super().release(slot)
        for key in [k for k in self.chunk_injection if k[0] == slot]:
            del self.chunk_injection[key]

    def _boundary_meta(self, b: StepBatch, rows: np.ndarray, tokens: torch.Tensor) -> AttentionMetadata:
        """Metadata of ``rows`` on the boundary cache: depth 0, their plane-0 pages and slots."""
        m, dev = b.meta, self.device
        lens = b.row_len[rows]
        cu = np.zeros(len(rows) + 1, np.int32)
        np.cumsum(lens, out=cu[1:])
        seq = b.row_start[rows] + lens
        rows_dev = torch.from_numpy(rows).to(dev)
        slots = m.plane0_slot_mapping.index_select(0, tokens)
        return AttentionMetadata(
            query_start_loc=torch.from_numpy(cu).to(dev), seq_lens=torch.from_numpy(seq.astype(np.int32)).to(dev),
            query_depth=torch.zeros(len(rows), dtype=torch.int32, device=dev),
            block_tables=m.block_tables.index_select(0, rows_dev)[:, :1].contiguous(),
            slot_mapping=slots, plane0_slot_mapping=slots,
            token_query_depth=torch.zeros(len(tokens), dtype=torch.int32, device=dev),
            positions=m.positions.index_select(0, tokens),
            max_query_len=int(lens.max()) if len(rows) else 0, max_seq_len=int(seq.max()) if len(rows) else 0,
            layout=KVLayout.SHARED,
        )

    def _enter(self, b: StepBatch, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """Prelude and initial state of the depth-0 rows (the first ``num_depth0`` rows)."""
        rows = np.arange(b.num_depth0)
        tok = _token_index(b, rows)
        n = len(tok)
        meta = self.attention.prepare(self.boundary_kv, self._boundary_meta(b, rows, torch.from_numpy(tok).to(self.device)))
        e = self.model.prelude(b.embed_token_ids, (rope[0][:n], rope[1][:n]), self.boundary_kv, self.attention, meta)
        seeds, positions, scales = [], [], []
        for r in b.rows[:b.num_depth0]:
            seeds += [r.request.seed] * r.length
            positions += range(r.start, r.end)
            scales += [r.request.init_state_scale] * r.length
        return self.model.initial_state(seeds, positions, scales), e

    @torch.inference_mode()
    def execute(self, b: StepBatch) -> CompletedStep:
        meta = b.meta
        self.kv.stamp_depth(meta.plane0_slot_mapping, meta.token_query_depth)
        core_meta = self.attention.prepare(self.kv, meta)
        rope = self.model.rotary(meta.positions)
        s0, e0 = self._enter(b, rope) if b.num_depth0 else (None, None)
        x = gather_row_state(b, s0, self.hidden, self.chunk_hidden)
        injection = gather_row_state(b, e0, self.injection, self.chunk_injection)
        h = self.model.recurrent(x, rope, self.kv, self.attention, core_meta, injection=injection)

        exited = b.fixed_exit.copy()  # no exit gate: a row exits at its request's recurrence count
        keep_row_state(b, exited, h, h.index_select(0, b.row_last_token), self.hidden, self.chunk_hidden)
        keep_row_state(b, exited, injection, injection.index_select(0, b.row_last_token), self.injection,
                       self.chunk_injection)

        rows = np.nonzero(exited)[0]
        logits = None
        if len(rows):
            tok = torch.from_numpy(_token_index(b, rows)).to(self.device)
            bmeta = self.attention.prepare(self.boundary_kv, self._boundary_meta(b, rows, tok))
            ends = np.cumsum(b.row_len[rows]) - 1
            sample_rows = torch.from_numpy(ends[b.samples[rows]]).to(self.device)
            logits = self.model.coda(h.index_select(0, tok), (rope[0].index_select(0, tok), rope[1].index_select(0, tok)),
                                     self.boundary_kv, self.attention, bmeta, sample_rows=sample_rows)
        return CompletedStep(sample_exited(self.model, self.sampler, None, exited, b.samples, b.slots, logits=logits))
