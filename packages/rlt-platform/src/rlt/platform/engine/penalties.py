"""Repetition, frequency and presence penalties: per-slot token history on the device.

The definitions and order are vLLM's (and OpenAI's for the last two): for a row's logits ``z``,

1. ``repetition_penalty`` r: for every token in the prompt or the output so far, ``z / r`` where
   ``z > 0``, else ``z * r``;
2. ``frequency_penalty`` f: ``z - f * count`` (count: times the token was generated);
3. ``presence_penalty`` p: ``z - p`` for every token generated at least once,

applied after ``logit_bias`` and the min_tokens suppression and before temperature and the
filters, so greedy rows take the argmax of the penalised logits too (:func:`sampler.suppressed_logits`).

The history lives on the device because sampled tokens may never visit the host before the next
step samples (rlt-decode's lagged and device-planned steps): :class:`PenaltyState` holds, per
slot, how often each vocabulary id was generated (int32 ``[slots, vocab]``) and whether it is in
the prompt (bool ``[slots, vocab]``) — allocated when the sampler is built (``max_num_seqs × vocab
× 5`` bytes, out of the memory the KV sizing leaves), used only by steps with a penalised row, whose
parameters ride in the step's one sampling upload (:func:`penalty_arrays`).
A slot's history is rebuilt from its request (prompt, recorded output: a resumed request's too) by
the first penalised step after the slot was assigned; every penalised step then adds the tokens
it commits (a step whose exits only the device knows passes the exit mask). Rows of other slots
in the same step add theirs too — harmless, as a slot's history is rebuilt before its next
penalised request reads it.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from rlt.platform.engine.staging import to_device


@attrs.frozen(eq=False)
class PenaltyBatch:
    """The penalties of a step's sampled rows (device tensors, row-aligned with the logits)."""

    slots: torch.Tensor  # [M] int64: the rows' slots (where :meth:`PenaltyState.commit` counts their tokens)
    counts: torch.Tensor  # [M, vocab] int32: times each token was generated
    prompt: torch.Tensor  # [M, vocab] bool: in the prompt
    presence: torch.Tensor  # [M] fp32
    frequency: torch.Tensor  # [M] fp32
    repetition: torch.Tensor  # [M] fp32


#: penalised logits saturate here: finite after temperature's division down to its 1e-6 floor (the sampler's)
SATURATE = 1.0e30


def apply_penalties(logits: torch.Tensor, pb: PenaltyBatch) -> torch.Tensor:
    """``logits`` [M, vocab] fp32 penalised (a new tensor); -inf (a banned token) stays -inf, and an
    extreme repetition penalty saturates a finite logit at +-``SATURATE`` rather than at infinity (so
    a sampled row's scaled logits never hold inf, nor its softmax inf - inf)."""
    generated = pb.counts > 0
    rep = pb.repetition[:, None]
    repeated = torch.where(logits > 0, (logits / rep).clamp_max(SATURATE),
                           torch.where(logits == float("-inf"), logits, (logits * rep).clamp_min(-SATURATE)))
    logits = torch.where(generated | pb.prompt, repeated, logits)
    return logits - pb.frequency[:, None] * pb.counts - pb.presence[:, None] * generated


def penalty_arrays(table, slots: np.ndarray) -> dict[str, np.ndarray]:
    """The host columns a step with a penalised row uploads (with the rest of its sampling parameters,
    in one upload: :func:`sampler.build_sampling_batch`) for :meth:`PenaltyState.gather`."""
    return {"pen_slots": slots.astype(np.int64), "presence": table.presence_penalty[slots],
            "frequency": table.frequency_penalty[slots], "repetition": table.repetition_penalty[slots]}


class PenaltyState:
    """Per-slot token history on ``device``; the slot table's penalty columns say who uses it."""

    def __init__(self, table, vocab_size: int, device: torch.device) -> None:
        self.table = table
        n = len(table.penalized)
        self.counts = torch.zeros(n, vocab_size, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(n, vocab_size, dtype=torch.bool, device=device)

    @property
    def nbytes(self) -> int:
        return self.counts.numel() * self.counts.element_size() + self.prompt.numel()

    def _rebuild(self) -> None:
        """The history of every slot assigned a penalised request since the last penalised step:
        its prompt's tokens and its recorded output's counts. A slot leaves the pending set only once
        rebuilt (a failure leaves the rest pending); the copies wait for nothing (``to_device``)."""
        pending = self.table.penalty_resets
        dev = self.counts.device
        for slot in list(pending):
            req = pending[slot]
            self.counts[slot].zero_()
            self.prompt[slot].zero_()
            self.prompt[slot].index_fill_(0, to_device(np.asarray(req.prompt_token_ids, np.int64), dev), True)
            if req.output_token_ids:
                out = to_device(np.asarray(req.output_token_ids, np.int64), dev)
                self.counts[slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
            del pending[slot]

    def gather(self, dev: dict[str, torch.Tensor]) -> PenaltyBatch:
        """The penalties of a step's rows from their uploaded :func:`penalty_arrays` (after rebuilding
        any newly assigned slot's history)."""
        if self.table.penalty_resets:
            self._rebuild()
        at = dev["pen_slots"]
        return PenaltyBatch(at, self.counts.index_select(0, at), self.prompt.index_select(0, at),
                            dev["presence"], dev["frequency"], dev["repetition"])

    def commit(self, pb: PenaltyBatch, tokens: torch.Tensor, committed: torch.Tensor | None) -> None:
        """Count ``tokens`` [M] for the rows of ``pb`` at their slots; ``committed`` (bool [M], or None: all)
        masks the rows whose token counts (a step whose exits only the device knows samples every row)."""
        ones = torch.ones_like(tokens, dtype=torch.int32) if committed is None else committed.to(torch.int32)
        self.counts.view(-1).index_add_(0, pb.slots * self.counts.shape[1] + tokens, ones)
