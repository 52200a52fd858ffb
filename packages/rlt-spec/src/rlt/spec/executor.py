"""The speculative executor: the eager executor plus the device state of speculation rounds.

Every speculative row is a one-token row whose state between loops lives at its own entry of one
state table (``state_table``: the per-slot states ``hidden``, then a ring of ``R = max_drafts + 1``
entries per slot, ``draft_h``; :func:`rlt.spec.rows.ring_entry`, by position). So draft, verification
and chain rows of one request share steps at different positions and depths, and a static decode
path (rlt-decode's buffers and graphs) runs them like plain decode rows — reading and writing their
states by entry — and hands their heads back to :meth:`finish_decode`. This executor runs the
other steps (those with prompt rows) eagerly: plain rows exactly as :class:`EagerExecutor` (the
same call of the recurrent core for every row), speculative rows from and into their entries
(:meth:`_inputs` / :meth:`_keep`); the base step is told not to exit or sample them. After the
loop (:meth:`_heads`, both paths):

- synchronous rounds: a draft row reaching depth ``d`` draws the next draft from its logits (one
  LM-head call for all of them; for random rows its distribution ``q`` goes into ``draft_q``, by
  ring position); the round's verification rows, which entered at depth ``d`` from the drafts'
  states, are verified together when they reach full depth (one LM-head call over every round's
  positions), through the sampler's ``verify``;
- overlapped rounds (chain rows): draws a draft from each chain row reaching depth ``d`` and checks
  the draft of each chain row reaching full depth (one LM-head call for both), through the
  sampler's ``check``.

A request has at most ``R`` speculative rows in flight (consecutive positions), so their ring
entries never collide. Rollback is by frontier: nothing is copied; rejected positions' KV and depth
stamps are overwritten when the next round runs those positions from depth 0.
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
        #: this (eager) step's speculative rows (batch indices, their state-table entries on the
        #: device), and the per-row states the base step computed (set by :meth:`_keep`)
        self._spec: tuple[np.ndarray, torch.Tensor] | None = None
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
        if self._spec is not None:  # deeper speculative rows continue from their own entries
            rows, entries = self._spec
            deep = b.depth[rows] > 0
            if deep.any():
                sel = self._dev(np.nonzero(deep)[0])
                x[self._dev(b.row_token_start[rows[deep]])] = self.state_table[entries[sel]]
        return x

    def _keep(self, b, exited, h, last) -> None:
        # speculative rows also pass through the slot-state table here (several per slot: the last
        # one written wins); that entry is never read for them, and a plain row of the slot starts at depth 0
        super()._keep(b, exited, h, last)
        if self._spec is not None:
            rows, entries = self._spec
            self._last = last
            self.state_table[entries] = last[self._dev(rows)]

    @torch.inference_mode()
    def execute(self, b) -> CompletedStep:
        role = row_column(b.rows, "role", PLAIN, np.int8)
        spec = role != PLAIN
        if not spec.any():
            return super().execute(b)
        rows = np.nonzero(spec)[0]
        self._spec = (rows, self._dev(row_column([b.rows[i] for i in rows], "state_index", 0, np.int64)))
        changes = {"fixed_exit": b.fixed_exit & ~spec, "samples": b.samples & ~spec}
        if b.adaptive.any():  # the gate decides for plain rows only
            spec_dev = torch.from_numpy(spec).to(self.device)
            changes["max_loops"] = torch.where(spec_dev, _NEVER_EXIT, b.max_loops)
        try:
            base = super().execute(attrs.evolve(b, **changes)).result()
            last = self._last
        finally:
            self._spec, self._last = None, None
        return CompletedStep(self._heads(b, base, role, row_column(b.rows, "draft_loops", 0, np.int64), last))

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
            heads, v = self._verify(b, verified, last)
            parts.append((heads, v.num_tokens))
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
        """The next drafts of draft rows that reached depth d (-1 for a round's last position);
        ``q`` into the ring at the drafting position for random rows."""
        index = row_column([b.rows[i] for i in rows], "index", 0, np.int64)
        count = row_column([b.rows[i] for i in rows], "num_drafts", 0, np.int64)
        out = np.full(len(rows), -1, np.int64)
        sel = np.nonzero(index < count)[0]
        if not len(sel):
            return out
        drafting = rows[sel]
        tokens, q = self.sampler.draft(self.model.coda(last.index_select(0, self._dev(drafting))),
                                       b.slots[drafting], index[sel])
        if q is not None:
            self._q_buffer()[self._dev(b.slots[drafting]), self._dev(b.row_start[drafting] % self.ring)] = q
        out[sel] = tokens.cpu().numpy()
        return out

    def _verify(self, b, rows: np.ndarray, last: torch.Tensor):
        """Verify the rounds whose verification rows (``rows``: every position of each) reached
        full depth. Returns (the row of each round's first position, where its tokens are
        reported; the sampler's outcome per round)."""
        pick = [b.rows[i] for i in rows]
        order = sorted(range(len(rows)), key=lambda j: (pick[j].slot, pick[j].index))  # rounds, positions
        rows = rows[order]
        pick = [pick[j] for j in order]
        slots = b.slots[rows]
        index = row_column(pick, "index", 0, np.int64)
        first = index == 0
        row_of = np.cumsum(first) - 1
        drafts = row_column(pick, "draft", -1, np.int64)
        q = None
        if self.slots_random(slots):
            q = self._q_buffer()[self._dev(slots), self._dev(b.row_start[rows] % self.ring)]
            q = q * self._dev(drafts >= 0)[:, None]
        logits = self.model.coda(last.index_select(0, self._dev(rows)))
        return rows[first], self.sampler.verify(logits, slots, index, row_of, drafts, q, int(first.sum()))

    def slots_random(self, slots: np.ndarray) -> bool:
        return bool((self.sampler.table.temperature[slots] > 0).any())
