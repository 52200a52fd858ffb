"""The speculative executor: the eager executor plus the device state of speculation rounds.

Every speculative row is a one-token row whose state between loops lives at its own entry of one
state table (``state_table``: the per-slot states ``hidden``, then a ring of ``R = max_drafts + 1``
entries per slot; :func:`rlt.spec.rows.ring_entry`, by position). So draft, verification
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
- overlapped rounds (chain rows), on the device only (:meth:`_chain_device`): a row reaching depth
  ``d`` writes its draft into the token table (``token_table``, the state table's layout) at its
  entry — the chain's next row embeds it from there, the row's own check judges it there — and a
  row reaching full depth checks its draft (one LM-head call for both), through the sampler's
  ``check``; a per-slot flag (``dead``) marks the checks after a rejection invalid. The results are
  read at once (:meth:`_heads`) or, in rlt-decode's pipeline, lagged
  (:meth:`finish_decode_lagged`: a :class:`LaggedSpecStep` whose values reach pinned memory
  behind an event).

A request has at most ``R`` speculative rows in flight (consecutive positions), so their ring
entries never collide. Rollback is by frontier: nothing is copied; rejected positions' KV and depth
stamps are overwritten when the next round runs those positions from depth 0.
"""

from __future__ import annotations

import logging

import attrs
import numpy as np
import torch

from rlt.platform.engine.executor import CompletedStep, EagerExecutor, sample_exited
from rlt.platform.engine.interfaces import StepResult
from rlt.platform.engine.sampler import argmax_only
from rlt.platform.engine.staging import to_device
from rlt.spec.heads import PromotionError, WideHeads, fused_heads_usable, greedy_heads
from rlt.spec.rows import CHAIN, DRAFT, PLAIN, VERIFY, CandidateRow, SpecStepResult, row_column
from rlt.spec.verify import Checked
from rlt.spec.wide import Groups, first_row_pages, promote_winners, sync_pages, wide_accepted

_NEVER_EXIT = 1 << 30
log = logging.getLogger("rlt.spec")


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


@attrs.define(eq=False)
class ChainHeads:
    """What :meth:`SpeculativeExecutor._chain_device` leaves on the device for the checking rows."""

    checking: np.ndarray  # batch indices of the chain rows that reached full depth
    check: Checked | None = None
    valid: torch.Tensor | None = None  # [len(checking)] bool


class LaggedSpecStep:
    """Handle of a lagged step with chain rows: ``shape`` now; per row (token, counts, verdict)
    copied to pinned host memory behind an event, read by :meth:`result` (``packed`` None: no row
    yields anything, the result is ``shape`` itself)."""

    def __init__(self, shape: SpecStepResult, packed: torch.Tensor | None) -> None:
        self.shape = shape
        self._event = None
        self._result: SpecStepResult | None = None
        if packed is None:
            self._result = attrs.evolve(shape, accepted=np.zeros(len(shape.num_tokens), bool), lagged=False)
            return
        cuda = packed.device.type == "cuda"
        self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=cuda)
        self._host.copy_(packed, non_blocking=cuda)
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def done(self) -> bool:
        return self._result is not None or self._event is None or self._event.query()

    def result(self) -> SpecStepResult:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            tokens, counts, verdicts = self._host.numpy()
            self._result = attrs.evolve(self.shape, num_tokens=counts.copy(), token_ids=tokens[counts > 0].copy(),
                                        accepted=verdicts.astype(bool), lagged=False)
        return self._result


#: :meth:`SpeculativeExecutor._wide_heads`: the step's wide rows need the general heads path
_GENERAL = object()


@attrs.frozen
class _WideSplit:
    """A step's chain heads split for the fused path: the wide rows' part, the narrow rows (drafting,
    checking), all rows (for the general path after a failed launch), a first row's page sync."""

    heads: WideHeads
    narrow: tuple[np.ndarray, np.ndarray]
    all: tuple[np.ndarray, np.ndarray]
    first_sync: tuple[np.ndarray, np.ndarray] | None


class SpeculativeExecutor(EagerExecutor):
    def __init__(self, *, max_drafts: int, width: int = 1, block_tables: np.ndarray | None = None, **kw) -> None:
        super().__init__(**kw)
        n, h = self.hidden.shape
        self.max_drafts = max_drafts
        #: ring entries per slot: a round's K + 1 positions, or a chain's in-flight positions
        self.ring = max_drafts + 1
        #: wide chains' candidates per position (:mod:`rlt.spec.wide`; 1: none) and the KV manager's
        #: host page tables (a first row's page, a winner's destination)
        self.width = width
        self.block_tables = block_tables
        #: one state table: the per-slot states, then ``ring`` entries per slot (:func:`ring_entry`), then
        #: ``width`` candidate entries per slot when chains are wide (:func:`rlt.spec.rows.wide_entry`), so
        #: that a static decode path (rlt-decode) addresses a chain row's state like any row's
        entries = n * (1 + self.ring) + (n * width if width > 1 else 0)
        self.state_table = torch.zeros(entries, h, dtype=self.hidden.dtype, device=self.device)
        #: wide chains' fused heads: per slot the winner its last check found, and past the token table's
        #: entries, per slot ``width`` x ``width`` scratch entries (each candidate's best next tokens)
        self.winner = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.scratch_base = entries
        self.hidden = self.state_table[:n]
        self.draft_q: torch.Tensor | None = None
        #: the token table (``Executor.token_table``, the same layout as the state table): per slot
        #: the last token sampled for it, then per ring entry the draft its row made — what a chain
        #: row's successor embeds, and what its own check judges, without the host reading it
        self.token_table = torch.zeros(entries + (n * width * width if width > 1 else 0), dtype=torch.int64,
                                       device=self.device)
        #: per slot: a check of its current chain rejected (the chain's later rows ran on a wrong
        #: token: their checks are invalid); cleared by the next chain's first row
        self.dead = torch.zeros(n, dtype=torch.bool, device=self.device)
        #: this (eager) step's depth-0 rows whose input is a device-only draft (batch indices, entries)
        self._on_device: tuple[np.ndarray, torch.Tensor] | None = None
        #: this (eager) step's speculative rows (batch indices, their state-table entries on the
        #: device), and the per-row states the base step computed (set by :meth:`_keep`)
        self._spec: tuple[np.ndarray, torch.Tensor] | None = None
        self._last: torch.Tensor | None = None
        #: why the fused greedy heads (:mod:`rlt.spec.heads`) stopped being used, after a launch raised ("" while usable)
        self.fused_heads_off = ""

    @classmethod
    def from_context(cls, ctx, *, max_drafts: int, width: int = 1) -> "SpeculativeExecutor":
        return cls(model=ctx.model, kv=ctx.cache, attention=ctx.attention, sampler=ctx.parts.sampler,
                   max_num_seqs=ctx.max_num_seqs, device=ctx.device, max_drafts=max_drafts, width=width,
                   block_tables=ctx.parts.kv_manager.block_tables)

    def _q_buffer(self) -> torch.Tensor:
        if self.draft_q is None:
            n = self.hidden.shape[0]
            self.draft_q = torch.zeros(n, self.ring, self.model.shape.vocab_size, dtype=torch.float32,
                                       device=self.device)
        return self.draft_q

    def _dev(self, a: np.ndarray) -> torch.Tensor:
        return to_device(a, self.device)  # no host wait: a lagged step must not wait for the device

    def _inputs(self, b) -> torch.Tensor:
        x = super()._inputs(b)
        if self._on_device is not None:  # the base step embedded a placeholder for these
            rows, entries = self._on_device
            x[self._dev(b.row_token_start[rows])] = self.model.prelude(self.token_table[entries])
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
        on_dev = np.asarray([i for i in rows if b.depth[i] == 0 and b.rows[i].input_on_device()], np.int64)
        if len(on_dev):
            self._on_device = (on_dev, self._dev(np.fromiter((b.rows[i].input_token_entry() for i in on_dev),
                                                            np.int64, len(on_dev))))
        changes = {"fixed_exit": b.fixed_exit & ~spec, "samples": b.samples & ~spec}
        if b.adaptive.any():  # the gate decides for plain rows only
            changes["max_loops"] = torch.where(self._dev(spec), _NEVER_EXIT, b.max_loops)
        try:
            base = super().execute(attrs.evolve(b, **changes)).result()
            last = self._last
        finally:
            self._spec, self._last, self._on_device = None, None, None
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

    def finish_decode_lagged(self, b, last: torch.Tensor):
        """A static decode step of plain and chain rows finished without a host read: plain rows
        sample on the device (their tokens into the token table at their slots), chain rows' heads
        run on the device (:meth:`_chain_device`); every row's token, whether it counts and its
        verdict go to pinned host memory behind an event. The handle's ``shape`` (host-known now)
        counts the plain rows' tokens only: a chain check's token counts when read (it may be
        invalid). Rows that want logprobs, or other speculative rows, make it read at once. Greedy
        heads take one kernel (:func:`rlt.spec.heads.greedy_heads`) where it runs; a step without
        heads does nothing on the device."""
        role = row_column(b.rows, "role", PLAIN, np.int8)
        if ((role == DRAFT) | (role == VERIFY)).any() or (self.sampler.table.logprobs[b.slots] >= 0).any():
            return CompletedStep(self.finish_decode(b, last, b.fixed_exit.copy()))
        n = b.num_rows
        plain = role == PLAIN
        sampled = np.nonzero(b.fixed_exit & b.samples & plain)[0]
        drafting, checking = self._chain_rows(b, np.nonzero(role == CHAIN)[0])
        exited = b.fixed_exit & plain
        exited[checking] = True
        shape_counts = np.zeros(n, np.int64)
        shape_counts[sampled] = 1
        shape = SpecStepResult(exited, shape_counts, np.zeros(0, np.int64), lagged=True)
        heads = np.concatenate([sampled, drafting, checking])
        if not len(heads):
            return LaggedSpecStep(shape, None)
        fused = not self.fused_heads_off and fused_heads_usable(last) and argmax_only(self.sampler.table, b.slots[heads])
        wide = self._wide_heads(b, drafting, checking) if fused else None
        if fused and wide is not _GENERAL:
            if wide is not None:
                drafting, checking = wide.narrow
            chain_rows = [b.rows[i] for i in np.concatenate([drafting, checking])]
            try:
                packed = greedy_heads(self.model, last, sampled=sampled, drafting=drafting, checking=checking,
                                      entries=row_column(chain_rows, "state_index", 0, np.int64), slots=b.slots,
                                      token_table=self.token_table, dead=self.dead,
                                      wide=None if wide is None else wide.heads)
            except PromotionError as exc:  # the heads ran, their winners did not: the step fails
                self.fused_heads_off = f"{type(exc).__name__}: {exc}"[:200]
                raise
            except Exception as exc:  # noqa: BLE001 - a compile / launch failure writes nothing: the general path
                self.fused_heads_off = f"{type(exc).__name__}: {exc}"[:200]
                log.warning("fused greedy heads failed; chain heads take the general path from now on: %s", exc)
                if wide is not None:
                    drafting, checking = wide.all
            else:
                if wide is not None and wide.first_sync is not None:
                    sync_pages(self.kv, *wide.first_sync, self.device)
                return LaggedSpecStep(shape, packed)
        tokens = torch.zeros(n, dtype=torch.int64, device=self.device)
        counts = torch.zeros(n, dtype=torch.int64, device=self.device)
        verdicts = torch.zeros(n, dtype=torch.int64, device=self.device)
        if len(sampled):
            rows = self._dev(sampled)
            out = self.sampler.sample(self.model.coda(last.index_select(0, rows)), b.slots[sampled])
            self.token_table[self._dev(b.slots[sampled])] = out.token_ids
            tokens[rows], counts[rows] = out.token_ids, 1
        if len(drafting) or len(checking):
            heads = self._chain_device(b, drafting, checking, last)
            if heads.check is not None:
                rows = self._dev(heads.checking)
                tokens[rows] = heads.check.token_ids
                counts[rows] = heads.valid.long()
                verdicts[rows] = heads.check.accepted.long()
        return LaggedSpecStep(shape, torch.stack([tokens, counts, verdicts]))

    def _wide_heads(self, b, drafting: np.ndarray, checking: np.ndarray):
        """A lagged step's wide-chain rows for the fused heads (:class:`rlt.spec.heads.WideHeads`): checks
        against the candidates, first rows' drafts into the candidates' inputs, candidates' drafts into
        their scratch and their groups' promotion descriptor; None when the step has none; ``_GENERAL``
        when the fused kernels cannot take them (candidates of two draft depths in one step)."""
        rows = b.rows
        wide_d = row_column([rows[i] for i in drafting], "width", 1, np.int64) > 1
        wide_c = row_column([rows[i] for i in checking], "width", 1, np.int64) > 1
        if not wide_d.any() and not wide_c.any():
            return None
        wchk, wdr = checking[wide_c], drafting[wide_d]
        w = self.width
        first = [rows[i] for i in wdr if not isinstance(rows[i], CandidateRow)]
        groups = {rows[i].slot: rows[i] for i in wdr if isinstance(rows[i], CandidateRow)}
        if len({len(r.lane[0]) for r in groups.values()}) > 1:
            return _GENERAL  # two draft depths in one step (requests' own draft_loops): the general path
        # checks judge the candidates' inputs; first rows draft into them, candidates into their scratch
        entries = [rows[i].candidates[0] if not isinstance(rows[i], CandidateRow)
                   else self._scratch(rows[i].slot) + rows[i].candidate * w for i in np.concatenate([wchk, wdr])]
        desc, planes = np.zeros((0, 0), np.int64), 0
        if groups:
            g = Groups.of([groups[s] for s in sorted(groups)], self.block_tables, self.kv.block_size)
            desc, planes = g.descriptor(self._scratch(g.slots)), g.num_planes
        narrow = (drafting[~wide_d], checking[~wide_c])
        heads = WideHeads(checking=wchk, drafting=wdr, entries=np.asarray(entries, np.int64), width=w,
                          winner=self.winner, groups=desc, planes=planes, kv=self.kv, state=self.state_table)
        return _WideSplit(heads, narrow, (drafting, checking),
                          first_row_pages(first, self.block_tables, self.kv.block_size))

    def _scratch(self, slots):
        """The token-table entries of slots' scratch (the fused heads' candidates' W best, W per candidate)."""
        return self.scratch_base + slots * self.width * self.width

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
            heads = self._chain_device(b, *self._chain_rows(b, chain), last)
            if heads.check is not None:
                c = heads.check
                checked = heads.checking
                # one readback: tokens, validity (False only behind an unread lagged rejection), verdicts
                tokens, valid, ok = torch.stack([c.token_ids, heads.valid.long(), c.accepted.long()]).cpu().numpy()
                valid = valid.astype(bool)
                exited[checked] = True
                accepted = np.zeros(b.num_rows, bool)
                accepted[checked] = ok.astype(bool)
                parts.append((checked[valid], np.ones(int(valid.sum()), np.int64)))
                arrays.append((tokens[valid], *(None if t is None else t[heads.valid].cpu().numpy()
                                                 for t in (c.logprobs, c.top_ids, c.top_logprobs))))
        num, dests = _scatter_rows(b.num_rows, parts)
        total = int(num.sum())
        ids, lp, top_ids, top_lp = (
            _merge(total, dests, col, fill, dt)
            for col, fill, dt in zip(zip(*arrays), (-1, np.nan, -1, np.nan), (np.int64, np.float32, np.int64, np.float32))
        )
        return SpecStepResult(
            exited, num, ids if ids is not None else np.zeros(0, np.int64), lp, top_ids, top_lp,
            prompt_logprobs=base.prompt_logprobs, draft_tokens=draft_tokens, accepted=accepted)

    def _chain_rows(self, b, chain: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The chain rows (batch indices ``chain``) that draft (reaching depth ``d``) and that check
        (reaching full depth) after this step. A chain's first row clears its slot's rejection flag
        here, before any check of the step reads it."""
        first = [i for i in chain if b.depth[i] == 0 and b.rows[i].first]
        if first:
            self.dead[self._dev(b.slots[first])] = False
        d = row_column([b.rows[i] for i in chain], "draft_loops", 0, np.int64)
        return chain[b.depth[chain] + 1 == d], chain[b.fixed_exit[chain]]

    def _chain_device(self, b, drafting: np.ndarray, checking: np.ndarray, last: torch.Tensor) -> ChainHeads:
        """Chain rows' heads (:meth:`_chain_rows`), on the device only: rows reaching full depth
        (``checking``) check the draft at their entry — a wide chain's row any of the next
        position's candidates (:mod:`rlt.spec.wide`) —, then rows reaching depth ``d``
        (``drafting``) draft the next token into the token table at their entries (``q`` into the
        ring); a wide chain's first row its ``W`` best into the candidates' entries, its candidates
        theirs, of which the winner's are kept (one LM-head call for all). A check is *valid*
        unless an earlier check of its slot rejected since the slot's chain began (its row then ran
        on a wrong token): a valid rejection sets the flag, and only valid checks write their token
        to the slot's entry (what the next step embeds, and what picks a wide position's winner)."""
        heads = np.concatenate([checking, drafting])
        out = ChainHeads(checking)
        if not len(heads):
            return out
        rows = [b.rows[i] for i in heads]
        slots = b.slots[heads]
        entries = self._dev(row_column(rows, "state_index", 0, np.int64))
        ring = b.row_start[heads] % self.ring
        # the generation step of the token each row yields (its position past the prompt), relative
        # to the slot's count the sampler adds: independent of how many tokens the host has read
        num_prompt = np.fromiter((r.request.num_prompt for r in rows), np.int64, len(rows))
        offsets = b.row_start[heads] + 1 - num_prompt - self.sampler.table.num_generated[slots]
        logits = self.model.coda(last.index_select(0, self._dev(heads)))
        nc = len(checking)
        if nc:
            s_dev = self._dev(slots[:nc])
            q = None
            if self.slots_random(slots[:nc]):
                q = self._q_buffer()[s_dev, self._dev(ring[:nc])]
            width = row_column(rows[:nc], "width", 1, np.int64)
            wide = np.nonzero(width > 1)[0]
            drafts = self.token_table[entries[:nc]]
            if len(wide):  # a wide row's drafts: the next position's candidates (the first one here)
                cand = self._dev(np.stack([rows[i].candidates for i in wide]))
                drafts[self._dev(wide)] = self.token_table[cand[:, 0]]
            check = self.sampler.check(logits[:nc], slots[:nc], offsets[:nc], drafts, q)
            if len(wide):
                accepted = check.accepted.clone()
                accepted[self._dev(wide)] = wide_accepted(self.token_table[cand], check.token_ids[self._dev(wide)])
                check = attrs.evolve(check, accepted=accepted)
            out.check = check
            out.valid = ~self.dead[s_dev]
            self.dead[s_dev] = self.dead[s_dev] | (out.valid & ~out.check.accepted)
            self.token_table[s_dev] = torch.where(out.valid, out.check.token_ids, self.token_table[s_dev])
        if len(drafting):
            self._drafts(b, rows[nc:], slots[nc:], entries[nc:], ring[nc:], offsets[nc:], logits[nc:])
        return out

    def _drafts(self, b, rows, slots, entries, ring, offsets, logits) -> None:
        """The drafting chain rows' heads (:meth:`_chain_device`): plain chains' rows draft one token
        at their entries; a wide chain's first row and candidates as :mod:`rlt.spec.wide` says."""
        kind = np.fromiter((2 if isinstance(r, CandidateRow) else int(r.width > 1) for r in rows), np.int8, len(rows))
        narrow = np.nonzero(kind == 0)[0]
        if len(narrow):
            sel = self._dev(narrow)
            tokens, q = self.sampler.draft(logits[sel], slots[narrow], offsets[narrow])
            self.token_table[entries[sel]] = tokens
            if q is not None:
                self._q_buffer()[self._dev(slots[narrow]), self._dev(ring[narrow])] = q
        first = np.nonzero(kind == 1)[0]
        if len(first):  # the candidates' inputs, and the page below d into their private blocks
            cand = self._dev(np.stack([rows[i].candidates for i in first]))
            self.token_table[cand.view(-1)] = logits[self._dev(first)].topk(self.width, dim=-1).indices.reshape(-1)
            pages = first_row_pages([rows[i] for i in first], self.block_tables, self.kv.block_size)
            if pages is not None:
                sync_pages(self.kv, *pages, self.device)
        cands = np.nonzero(kind == 2)[0]
        if len(cands):
            order = np.asarray(sorted(cands, key=lambda i: (rows[i].slot, rows[i].candidate)), np.int64)
            planes = np.fromiter((len(rows[i].lane[0]) for i in order), np.int64, len(order))
            for p in np.unique(planes):  # one draft depth per call (one, but for requests' own draft_loops)
                self._promote([rows[i] for i in order[planes == p]], logits[self._dev(order[planes == p])])

    def _promote(self, rows, logits) -> None:
        """Candidates (``rows``, slot by slot in candidate order) that reached depth ``d``: their
        winners (:func:`rlt.spec.wide.promote_winners`)."""
        if len(rows) % self.width or any(r.candidate != j % self.width for j, r in enumerate(rows)):
            raise RuntimeError("a wide chain's candidates must reach depth d together, all of them")
        promote_winners(kv=self.kv, state_table=self.state_table, token_table=self.token_table, logits=logits,
                        groups=Groups.of(rows[:: self.width], self.block_tables, self.kv.block_size),
                        device=self.device)

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
