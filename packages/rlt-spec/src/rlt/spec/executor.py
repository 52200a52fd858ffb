"""The speculative executor: the eager executor plus the device state of speculation rounds.

Owns, per slot, a ring of ``R = max_drafts + 1`` hidden states (``draft_h``) and, for random rows,
of draft distributions ``q`` (``draft_q``, allocated on first use). Plain rows run exactly as in
:class:`EagerExecutor` (the same step: one call of the recurrent core for every row). Speculative
rows run in that same call; the base step is told not to exit or sample them, and this executor
then

- synchronous rounds: stores the depth-``d`` hidden state of each draft row that reached depth
  ``d`` at ``draft_h[slot, index]`` and draws the next draft from its logits (one LM-head call for
  all of them); gives a verification row entering at depth ``d`` the drafts' hidden states as its
  input; verifies every verification row that reached full depth (one LM-head call over all their
  positions), through the sampler's ``verify``;
- overlapped rounds (chain rows, several one-token rows of one slot in a step): keeps each chain
  row's state between loops at ``draft_h[slot, position % R]`` instead of the slot's single state
  (:meth:`_inputs` / :meth:`_keep`); draws a draft from each chain row reaching depth ``d`` and
  checks the draft of each chain row reaching full depth (one LM-head call for both), through the
  sampler's ``check``. A request has at most ``R`` chain rows in flight (consecutive positions),
  so their ring entries never collide.

The ring is the tail of one state table (``state_table``: the per-slot states ``hidden``, then the
rings; a chain row's entry is its ``state_index``, :func:`rlt.spec.rows.ring_entry`), so a static
decode path (rlt-decode's buffers and graphs) runs draft and chain rows like plain decode rows —
reading and writing their states by entry — and hands their heads back to :meth:`finish_decode`;
only steps with verification rows (multi-token) always run here, eagerly.

Rollback is by frontier: nothing is copied; rejected positions' KV and depth stamps are
overwritten when the next round runs those positions from depth 0.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from rlt.platform.engine.executor import CompletedStep, EagerExecutor, sample_exited
from rlt.platform.engine.interfaces import StepResult
from rlt.spec.rows import CHAIN, DRAFT, PLAIN, VERIFY, SpecStepResult, row_column

_NEVER_EXIT = 1 << 30


def _scatter_rows(num_rows: int, parts) -> tuple[np.ndarray, np.ndarray]:
    """Merge ragged per-row token sources that own disjoint rows: ``parts`` is a list of
    ``(rows, counts)``. Returns (num_tokens [R], for each part the destination indices of its
    flat tokens)."""
    num = np.zeros(num_rows, np.int64)
    for rows, counts in parts:
        num[rows] = counts
    off = np.zeros(num_rows + 1, np.int64)
    np.cumsum(num, out=off[1:])
    dests = []
    for rows, counts in parts:
        first = np.repeat(off[rows], counts)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        dests.append(first + within)
    return num, dests


def _merge(total: int, dests, arrays, fill, dtype):
    """One flat array from per-part arrays (None parts are filled with ``fill``)."""
    present = [a for a in arrays if a is not None]
    if not present:
        return None
    width = max((a.shape[1] for a in present if a.ndim == 2), default=None)
    shape = (total,) if width is None else (total, width)
    out = np.full(shape, fill, dtype)
    for d, a in zip(dests, arrays):
        if a is not None and len(d):
            if a.ndim == 2:
                out[d, : a.shape[1]] = a
            else:
                out[d] = a
    return out


class SpeculativeExecutor(EagerExecutor):
    def __init__(self, *, max_drafts: int, **kw) -> None:
        super().__init__(**kw)
        n, h = self.hidden.shape
        self.max_drafts = max_drafts
        #: ring entries per slot: a round's K + 1 positions, or a chain's in-flight positions
        self.ring = max_drafts + 1
        #: one state table: the per-slot states, then ``ring`` entries per slot (:func:`ring_entry`), so
        #: that a static decode path (rlt-decode) addresses a chain row's state like any row's
        self.state_table = torch.zeros(n * (1 + self.ring), h, dtype=self.hidden.dtype, device=self.device)
        self.hidden = self.state_table[:n]
        self.draft_h = self.state_table[n:].view(n, self.ring, h)
        self.draft_q: torch.Tensor | None = None
        #: this step's chain rows (batch indices, their state-table entries on the device), and
        #: the per-row states the base step computed (set by :meth:`_keep`)
        self._chain: tuple[np.ndarray, torch.Tensor] | None = None
        self._spec_step = False
        self._last: torch.Tensor | None = None

    @classmethod
    def from_context(cls, ctx, *, max_drafts: int) -> "SpeculativeExecutor":
        return cls(model=ctx.model, kv=ctx.cache, attention=ctx.attention, sampler=ctx.parts.sampler,
                   max_num_seqs=ctx.max_num_seqs, device=ctx.device, max_drafts=max_drafts)

    def _q_buffer(self) -> torch.Tensor:
        if self.draft_q is None:
            n = self.hidden.shape[0]
            self.draft_q = torch.zeros(n, self.ring, self.model.shape.vocab_size, dtype=torch.float32,
                                       device=self.device)
        return self.draft_q

    def _dev(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _inputs(self, b) -> torch.Tensor:
        x = super()._inputs(b)
        if self._chain is not None:  # deeper chain rows continue from their own ring entry
            rows, entries = self._chain
            deep = b.depth[rows] > 0
            if deep.any():
                sel = self._dev(np.nonzero(deep)[0])
                x[self._dev(b.row_token_start[rows[deep]])] = self.state_table[entries[sel]]
        return x

    def _keep(self, b, exited, h, last) -> None:
        # chain rows also pass through the slot-state table here (several per slot: the last one
        # written wins); that entry is never read for them, and a plain row of the slot starts at depth 0
        super()._keep(b, exited, h, last)
        if self._spec_step:
            self._last = last
        if self._chain is not None:
            rows, entries = self._chain
            self.state_table[entries] = last[self._dev(rows)]

    @torch.inference_mode()
    def execute(self, b) -> CompletedStep:
        role = row_column(b.rows, "role", PLAIN, np.int8)
        spec = role != PLAIN
        if not spec.any():
            return super().execute(b)
        d = row_column(b.rows, "draft_loops", 0, np.int64)
        verify = role == VERIFY
        chain = np.nonzero(role == CHAIN)[0]
        for i in np.nonzero(verify & (b.depth == d))[0]:  # entering: the drafts' depth-d states
            slot, n = int(b.slots[i]), int(b.row_len[i])
            if n == 1:  # a one-token row (the round shrank to no drafts) reads the slot's state
                self.hidden[slot] = self.draft_h[slot, 0]
            else:
                self.chunk_hidden[(slot, int(b.row_start[i]))] = self.draft_h[slot, :n]
        self._chain = None
        if len(chain):
            self._chain = (chain, self._dev(row_column([b.rows[i] for i in chain], "state_index", 0, np.int64)))
        changes = {"fixed_exit": b.fixed_exit & ~spec, "samples": b.samples & ~spec}
        if b.adaptive.any():  # the gate decides for plain rows only
            spec_dev = torch.from_numpy(spec).to(self.device)
            changes["max_loops"] = torch.where(spec_dev, _NEVER_EXIT, b.max_loops)
        self._spec_step = True
        try:
            base = super().execute(attrs.evolve(b, **changes)).result()
            last = self._last
        finally:
            self._chain, self._last, self._spec_step = None, None, False
        return CompletedStep(self._heads(b, base, role, d, last))

    def finish_decode(self, b, last: torch.Tensor, exited: np.ndarray):
        """After the loop of one-token rows run by a static decode path (rlt-decode): plain rows as
        the base executor, then draft and chain rows' heads as in :meth:`execute` (their states are
        already at their state-table entries)."""
        role = row_column(b.rows, "role", PLAIN, np.int8)
        spec = role != PLAIN
        if not spec.any():
            return super().finish_decode(b, last, exited)
        base = sample_exited(self.model, self.sampler, last, exited & ~spec, b.samples & ~spec, b.slots)
        return self._heads(b, base, role, row_column(b.rows, "draft_loops", 0, np.int64), last)

    def _heads(self, b, base: StepResult, role: np.ndarray, d: np.ndarray, last: torch.Tensor) -> SpecStepResult:
        """The step's result: ``base`` (the plain rows') merged with what the speculative rows
        yield: drafts of draft rows reaching depth ``d``, verification of verification rows reaching
        full depth, chain rows' drafts and checks. ``last``: every row's end-of-loop state."""
        loop = b.depth + 1
        verify = role == VERIFY
        chain = np.nonzero(role == CHAIN)[0]
        drafted = np.nonzero((role == DRAFT) & (loop >= d))[0]
        verified = np.nonzero(verify & b.fixed_exit)[0]
        exited = base.exited.copy()
        exited[drafted] = True
        exited[verified] = True
        draft_tokens = np.full(b.num_rows, -1, np.int64)
        accepted = None
        if len(drafted):
            draft_tokens[drafted] = self._draft(b, drafted, last)
        plain_rows = np.nonzero(base.num_tokens)[0]
        parts = [(plain_rows, base.num_tokens[plain_rows])]
        arrays = [(base.token_ids, base.logprobs, base.top_ids, base.top_logprobs)]
        if len(verified):
            v = self._verify(b, verified)
            parts.append((verified, v.num_tokens))
            arrays.append((v.token_ids, v.logprobs, v.top_ids, v.top_logprobs))
        if len(chain):
            checked, ok, v = self._chain_heads(b, chain, d, last, draft_tokens)
            if len(checked):
                exited[checked] = True
                accepted = np.zeros(b.num_rows, bool)
                accepted[checked] = ok
                parts.append((checked, v.num_tokens))
                arrays.append((v.token_ids, v.logprobs, v.top_ids, v.top_logprobs))
        num, dests = _scatter_rows(b.num_rows, parts)
        total = int(num.sum())
        ids, lp, top_ids, top_lp = (
            _merge(total, dests, col, fill, dt)
            for col, fill, dt in zip(zip(*arrays), (-1, np.nan, -1, np.nan), (np.int64, np.float32, np.int64, np.float32))
        )
        return SpecStepResult(
            exited, num, ids if ids is not None else np.zeros(0, np.int64), lp, top_ids, top_lp,
            prompt_logprobs=base.prompt_logprobs, draft_tokens=draft_tokens, accepted=accepted)

    def _chain_heads(self, b, chain: np.ndarray, d: np.ndarray, last: torch.Tensor, draft_tokens: np.ndarray):
        """One LM-head call for the chain rows that reached depth ``d`` (their drafts go into
        ``draft_tokens``; ``q`` into the ring) and those that reached full depth (their drafts are
        checked). Returns (the checked rows, whether each draft was accepted, their tokens)."""
        loop = b.depth[chain] + 1
        drafting = chain[loop == d[chain]]
        checking = chain[b.fixed_exit[chain]]
        heads = np.concatenate([drafting, checking])
        if not len(heads):
            return checking, None, None
        rows = [b.rows[i] for i in heads]
        # generation step of the token each row yields: its position past the request's last token
        offsets = np.fromiter((r.start - r.request.num_prompt - r.request.num_produced + 1 for r in rows), np.int64,
                              len(rows))
        slots = b.slots[heads]
        ring = b.row_start[heads] % self.ring
        logits = self.model.coda(last.index_select(0, self._dev(heads)))
        nd = len(drafting)
        if nd:
            tokens, q = self.sampler.draft(logits[:nd], slots[:nd], offsets[:nd])
            if q is not None:
                self._q_buffer()[self._dev(slots[:nd]), self._dev(ring[:nd])] = q
            draft_tokens[drafting] = tokens.cpu().numpy()
        if not len(checking):
            return checking, None, None
        drafts = row_column(rows[nd:], "draft", -1, np.int64)
        q = None
        if self.slots_random(slots[nd:]):
            q = self._q_buffer()[self._dev(slots[nd:]), self._dev(ring[nd:])]
        ok, v = self.sampler.check(logits[nd:], slots[nd:], offsets[nd:], drafts, q)
        return checking, ok, v

    def _draft(self, b, rows: np.ndarray, last: torch.Tensor) -> np.ndarray:
        """Keep the depth-d states of draft rows that reached depth d; draw the next drafts."""
        slots = b.slots[rows]
        index = row_column([b.rows[i] for i in rows], "index", 0, np.int64)
        count = row_column([b.rows[i] for i in rows], "num_drafts", 0, np.int64)
        slots_dev = torch.from_numpy(slots).to(self.device)
        h = last.index_select(0, self._dev(rows))
        self.draft_h[slots_dev, torch.from_numpy(index).to(self.device)] = h
        out = np.full(len(rows), -1, np.int64)
        need = index < count
        if not need.any():
            return out
        sel = np.nonzero(need)[0]
        logits = self.model.coda(h[torch.from_numpy(sel).to(self.device)] if not need.all() else h)
        tokens, q = self.sampler.draft(logits, slots[sel], index[sel])
        if q is not None:
            self._q_buffer()[slots_dev[sel], torch.from_numpy(index[sel]).to(self.device)] = q
        out[sel] = tokens.cpu().numpy()
        return out

    def _verify(self, b, rows: np.ndarray):
        lens = b.row_len[rows]
        slots = b.slots[rows]
        # multi-token rows kept their states as chunks, one-token rows in the slot's state
        h = torch.cat([self.chunk_hidden.pop((int(s), int(p))) if n > 1 else self.hidden[int(s)][None]
                       for s, p, n in zip(slots, b.row_start[rows], lens)])
        logits = self.model.coda(h)
        row_of = np.repeat(np.arange(len(rows)), lens)
        local = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        drafts = np.full(len(row_of), -1, np.int64)
        has = local < np.repeat(lens - 1, lens)
        drafts[has] = np.fromiter((t for i in rows for t in b.rows[i].drafts[: int(b.row_len[i]) - 1]), np.int64)
        pos_slots = slots[row_of]
        q = None
        if self.slots_random(pos_slots):
            q = self._q_buffer()[torch.from_numpy(pos_slots).to(self.device),
                             torch.from_numpy(np.minimum(local, self.max_drafts - 1)).to(self.device)]
            q = q * torch.from_numpy(has).to(self.device)[:, None]
        return self.sampler.verify(logits, pos_slots, local, row_of, drafts, q, len(rows))

    def slots_random(self, slots: np.ndarray) -> bool:
        return bool((self.sampler.table.temperature[slots] > 0).any())
