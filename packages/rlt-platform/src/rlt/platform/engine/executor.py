"""The base executor: eager and synchronous.

``execute(batch) -> handle``; ``handle.result()`` gives the host-side outcome of the step (which
rows exited, the tokens sampled, their logprobs). Device state lives here, per slot: the hidden
state of every one-token row between loops, the hidden states of running multi-token chunks, and
the exit accumulator (``remaining``) of every row (:func:`gather_row_state` /
:func:`keep_row_state` move a per-row state in and out of a step). The attention backend's ``prepare`` runs once
per step, before the first layer. rlt-decode supplies pipelined and graph-replay executors behind
the same interface.
"""

from __future__ import annotations

import numpy as np
import torch

from rlt.attention import KVLayout
from rlt.platform.engine.batch import StepBatch
from rlt.platform.engine.exit_policy import OuroGateExit
from rlt.platform.engine.interfaces import StepResult
from rlt.platform.engine.prompt_logprobs import prompt_logprobs_for_batch


class CompletedStep:
    """Handle of a step that already ran (the eager executor finishes inside ``execute``)."""

    def __init__(self, result: StepResult) -> None:
        self._result = result

    def done(self) -> bool:
        return True

    def result(self) -> StepResult:
        return self._result


def _host(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.cpu().numpy()


def sample_exited(model, sampler, last: torch.Tensor | None, exited: np.ndarray, samples: np.ndarray,
                  slots: np.ndarray, prompt_logprobs=None, logits: torch.Tensor | None = None) -> StepResult:
    """The step's result: LM head and sampling for the rows (of ``last [R, hidden]``) that exited
    and produce a token, one token each; host copies of the sampled tokens and logprobs.
    ``logits``: the head's output for exactly those rows, already computed (then ``last`` is unused)."""
    rows = np.nonzero(exited & samples)[0]
    num_tokens = np.zeros(len(exited), np.int64)
    extra = {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}
    if len(rows) == 0:
        return StepResult(exited, num_tokens, np.zeros(0, np.int64), **extra)
    num_tokens[rows] = 1
    if logits is None:
        if len(rows) < len(exited):
            last = last.index_select(0, torch.from_numpy(rows).to(last.device))
        logits = model.coda(last)
    out = sampler.sample(logits, slots[rows])
    return StepResult(exited, num_tokens, _host(out.token_ids), _host(out.logprobs), _host(out.top_ids),
                      _host(out.top_logprobs), **extra)


def gather_row_state(b: StepBatch, depth0: torch.Tensor | None, table: torch.Tensor,
                     chunks: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
    """A per-token state in batch order: ``depth0`` (the depth-0 rows' tokens, computed by the
    caller), then the deeper one-token rows from ``table`` by slot, then the deeper chunks (taken
    out of ``chunks``) — the inverse of :func:`keep_row_state`."""
    parts = [] if depth0 is None else [depth0]
    if b.num_single:
        parts.append(table.index_select(0, b.slots_device[b.num_depth0:b.num_depth0 + b.num_single]))
    first = b.num_depth0 + b.num_single
    parts.extend(chunks.pop((int(s), int(p))) for s, p in zip(b.slots[first:], b.row_start[first:]))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def keep_row_state(b: StepBatch, exited: np.ndarray, h: torch.Tensor, last: torch.Tensor, table: torch.Tensor,
                   chunks: dict[tuple[int, int], torch.Tensor]) -> None:
    """Keep a per-row state of the rows that loop again: one-token decode rows in ``table`` by slot,
    prompt chunks of any length in ``chunks`` by (slot, first position) — the batch builder's row
    groups. ``h``: the state per token, ``last``: per row (its last token)."""
    single = (b.row_len == 1) & ~b.in_prompt
    if single.all():
        table.index_copy_(0, b.slots_device, last)
    elif single.any():
        sel = torch.from_numpy(np.nonzero(single)[0]).to(table.device)
        table.index_copy_(0, b.slots_device[sel], last[sel])
    for i in np.nonzero(~single & ~exited)[0]:
        start = int(b.row_token_start[i])
        chunks[(int(b.slots[i]), int(b.row_start[i]))] = h[start:start + int(b.row_len[i])]


class EagerExecutor:
    #: computes prompt logprobs when a prompt chunk exits
    supports_prompt_logprobs = True

    def __init__(self, *, model, kv, attention, sampler, max_num_seqs: int, device: torch.device,
                 exit_policy=OuroGateExit) -> None:
        self.model = model
        self.kv = kv
        self.attention = attention
        self.sampler = sampler
        self.device = device
        self.exit_policy = exit_policy
        self.exit_latency = exit_policy.decision_latency
        self.hidden = torch.zeros(max_num_seqs, model.shape.hidden_size, dtype=model.dtype, device=device)
        #: where one-token rows keep their state between loops, by ``Row.state_index`` (here: the slots)
        self.state_table = self.hidden
        self.remaining = torch.ones(max_num_seqs, dtype=torch.float32, device=device)
        #: hidden states of multi-token chunks between loops, by (slot, first position)
        self.chunk_hidden: dict[tuple[int, int], torch.Tensor] = {}

    @classmethod
    def from_context(cls, ctx) -> "EagerExecutor":
        return cls(model=ctx.model, kv=ctx.cache, attention=ctx.attention, sampler=ctx.parts.sampler,
                   max_num_seqs=ctx.max_num_seqs, device=ctx.device)

    def release(self, slot: int) -> None:
        for key in [k for k in self.chunk_hidden if k[0] == slot]:
            del self.chunk_hidden[key]

    def _keep(self, b: StepBatch, exited: np.ndarray, h: torch.Tensor, last: torch.Tensor) -> None:
        """Keep the state of the rows that loop again (:func:`keep_row_state`). A subclass that keeps
        some rows' state elsewhere (rlt-spec: several in-flight one-token rows of one slot) overrides
        it together with :meth:`_inputs`; ``h`` is per token, ``last`` per row, both in batch order."""
        keep_row_state(b, exited, h, last, self.hidden, self.chunk_hidden)

    def _inputs(self, b: StepBatch) -> torch.Tensor:
        depth0 = self.model.prelude(b.embed_token_ids) if b.num_depth0 else None
        return gather_row_state(b, depth0, self.hidden, self.chunk_hidden)

    def finish_decode(self, b, last: torch.Tensor, exited: np.ndarray) -> StepResult:
        """After the loop of one-token decode rows run by a static decode path: LM head and
        sampling of the rows that exited (``last``: their end-of-loop states, batch order)."""
        return sample_exited(self.model, self.sampler, last, exited, b.samples, b.slots)

    @torch.inference_mode()
    def execute(self, b: StepBatch) -> CompletedStep:
        meta = b.meta
        if self.kv.layout is KVLayout.LAST_EXITED:
            self.kv.stamp_depth(meta.plane0_slot_mapping, meta.token_query_depth)
        meta = self.attention.prepare(self.kv, meta)
        x = self._inputs(b)
        rope = self.model.rotary(meta.positions)
        h = self.model.recurrent(x, rope, self.kv, self.attention, meta)
        last = h.index_select(0, b.row_last_token)
        slots_dev = b.slots_device

        # Exit decision.
        if b.adaptive.any():
            remaining = torch.where(b.loop == 1, 1.0, self.remaining.index_select(0, slots_dev))
            exit_dev, remaining = self.exit_policy.decide(
                self.model.exit_logit(last), remaining, b.loop, b.min_loops, b.max_loops, b.threshold
            )
            self.remaining.index_copy_(0, slots_dev, remaining)
            exited = exit_dev.cpu().numpy()
        else:
            exited = b.fixed_exit.copy()

        self._keep(b, exited, h, last)
        plp = prompt_logprobs_for_batch(self.model, h, b.row_token_start, exited, b.prompt_logprobs)
        return CompletedStep(sample_exited(self.model, self.sampler, last, exited, b.samples, b.slots,
                                           prompt_logprobs=plp))
