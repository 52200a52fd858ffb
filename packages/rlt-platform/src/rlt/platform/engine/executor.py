"""The base executor: eager and synchronous.

``execute(batch) -> handle``; ``handle.result()`` gives the host-side outcome of the step (which
rows exited, the tokens sampled, their logprobs). Device state lives here, in slot tables:
the hidden state of every one-token row between loops, the hidden states of running multi-token
chunks, and the exit accumulator (``remaining``) of every row. rlt-decode supplies pipelined and
graph-replay executors behind the same interface.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from rlt.attention import AttentionBackend, KVCache, KVLayout
from rlt.platform.engine.batch import StepBatch
from rlt.platform.engine.exit_policy import OuroGateExit
from rlt.platform.engine.prompt_logprobs import prompt_logprobs_for_batch
from rlt.platform.engine.sampler import build_sampling_batch, sample
from rlt.platform.engine.slots import SlotTable
from rlt.platform.engine.staging import Staging
from rlt.platform.models.base import LoopedModel


@attrs.frozen(eq=False)
class StepResult:
    exited: np.ndarray  # [R] bool, row order of the batch
    sampled_rows: np.ndarray  # indices (into the batch rows) that produced a token
    token_ids: np.ndarray  # [len(sampled_rows)]
    logprobs: np.ndarray | None
    top_ids: np.ndarray | None
    top_logprobs: np.ndarray | None
    #: slot -> prompt logprob entries of the prompt chunk that exited this step (see prompt_logprobs.py)
    prompt_logprobs: dict = attrs.field(factory=dict)


class CompletedStep:
    """Handle of a step that already ran (the eager executor finishes inside ``execute``)."""

    def __init__(self, result: StepResult) -> None:
        self._result = result

    def done(self) -> bool:
        return True

    def result(self) -> StepResult:
        return self._result


class EagerExecutor:
    #: computes prompt logprobs when a prompt chunk exits (the engine rejects them otherwise)
    supports_prompt_logprobs = True

    def __init__(
        self,
        model: LoopedModel,
        kv: KVCache,
        attention: AttentionBackend,
        table: SlotTable,
        *,
        max_num_seqs: int,
        device: torch.device,
        exit_policy=OuroGateExit,
    ) -> None:
        self.model = model
        self.kv = kv
        self.attention = attention
        self.table = table
        self.device = device
        self.exit_policy = exit_policy
        hidden_size = model.shape.hidden_size
        self.hidden = torch.zeros(max_num_seqs, hidden_size, dtype=model.dtype, device=device)
        self.remaining = torch.ones(max_num_seqs, dtype=torch.float32, device=device)
        self.chunk_hidden: dict[int, torch.Tensor] = {}
        self.staging = Staging(device)

    def release(self, slot: int) -> None:
        self.chunk_hidden.pop(slot, None)

    def _inputs(self, b: StepBatch) -> torch.Tensor:
        parts = []
        if b.num_depth0:
            parts.append(self.model.prelude(b.embed_token_ids))
        if b.num_single:
            parts.append(self.hidden.index_select(0, b.slots_device[b.num_depth0:b.num_depth0 + b.num_single]))
        parts.extend(self.chunk_hidden[int(s)] for s in b.slots[b.num_depth0 + b.num_single:])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @torch.inference_mode()
    def execute(self, b: StepBatch) -> CompletedStep:
        meta = b.meta
        if self.kv.layout is KVLayout.LAST_EXITED:
            self.kv.stamp_depth(meta.plane0_slot_mapping, meta.token_query_depth)
        x = self._inputs(b)
        rope = self.model.rotary(meta.positions)
        h = self.model.recurrent(x, rope, self.kv, self.attention, meta)
        last = h.index_select(0, b.row_last_token)
        slots_dev = b.slots_device

        # Keep every row's state for its next loop (cheap; exited rows are simply overwritten).
        single = b.row_len == 1
        if single.all():
            self.hidden.index_copy_(0, slots_dev, last)
        elif single.any():
            sel = torch.from_numpy(np.nonzero(single)[0]).to(self.device)
            self.hidden.index_copy_(0, slots_dev[sel], last[sel])
        for i in np.nonzero(~single)[0]:
            start = int(b.row_token_start[i])
            self.chunk_hidden[int(b.slots[i])] = h[start:start + int(b.row_len[i])]

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

        plp = prompt_logprobs_for_batch(self.model, h, b.slots, b.row_token_start, exited, b.prompt_logprobs)
        rows = np.nonzero(exited & b.samples)[0]
        if len(rows) == 0:
            return CompletedStep(StepResult(exited, rows, np.zeros(0, np.int64), None, None, None, plp))
        if len(rows) == b.num_rows:
            logits = self.model.coda(last)
        else:
            logits = self.model.coda(last.index_select(0, torch.from_numpy(rows).to(self.device)))
        sb = build_sampling_batch(self.table, b.slots[rows], self.staging)
        out = sample(logits, sb)
        host = lambda t: None if t is None else t.cpu().numpy()  # noqa: E731
        return CompletedStep(StepResult(exited, rows, host(out.token_ids), host(out.logprobs),
                                        host(out.top_ids), host(out.top_logprobs), plp))
