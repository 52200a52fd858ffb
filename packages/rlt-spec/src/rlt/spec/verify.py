"""Draft sampling and verification: the sampler that also accepts drafts.

Both read the request's sampling parameters from the slot table exactly as the base sampler
does (suppression of stop tokens before ``min_tokens``, temperature, top-k / top-p), at the
generation step each position stands for, so the processed distributions are the ones plain
decoding draws from.

- Greedy rows: a draft is the argmax of the depth-``d`` logits; verification accepts a draft iff
  it equals the argmax of the full-depth logits at the same position, and the correction is that
  argmax. The emitted tokens are therefore the full-depth argmaxes: exact.
- Random rows (temperature > 0): a draft is drawn from ``q`` (the processed depth-``d``
  distribution) and accepted with probability ``min(1, p(x) / q(x))`` against the full-depth
  ``p``; the first rejected position emits a draw from ``norm(max(p - q, 0))``, and a round whose
  drafts all pass emits a draw from ``p`` at the last position. The output distribution is ``p``'s
  (Leviathan et al. 2023, Chen et al. 2023).
- Chain rows (overlapped rounds, :meth:`SpeculativeSampler.check`): each row checks the one draft
  it made at depth ``d`` by the same test and emits exactly one token — the draft, or the
  correction at the first rejection (after which the chain restarts from the correction). A fully
  accepted chain never needs a bonus draw: the next position's token is the next row's draft,
  checked in its turn. Each emitted token is therefore again distributed as ``p`` given the
  accepted prefix.

Noise is the counter-based noise of :mod:`rlt.platform.engine.sampler`, keyed by (request seed,
generation step, vocabulary id); drafts and acceptance tests use their own salted streams so the
three draws of one step are independent, and seeded results are reproducible. Logprobs are of the
raw full-depth distribution, as the base sampler reports them.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from rlt.platform.engine.interfaces import Wrapped
from rlt.platform.engine.sampler import (
    build_sampling_batch,
    gumbel_argmax,
    sampling_logits,
    suppressed_logits,
    uniform_noise,
)
from rlt.platform.engine.staging import to_device

DRAFT_SALT = 0x5EC1D7AF
ACCEPT_SALT = 0x0ACC3917


def _salted(batch, salt: int):
    return batch.seed_lo, batch.seed_hi ^ salt


@attrs.frozen(eq=False)
class Checked:
    """Device outcome of checking chain rows' drafts (one per row)."""

    accepted: torch.Tensor  # [M] bool
    token_ids: torch.Tensor  # [M] the draft if accepted, else the correction
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


@attrs.frozen(eq=False)
class Verified:
    """Host outcome of verifying a step's verification rows (flat arrays, row after row)."""

    num_tokens: np.ndarray  # [V] tokens each row emits (accepted drafts + 1)
    token_ids: np.ndarray  # [sum(num_tokens)]
    logprobs: np.ndarray | None
    top_ids: np.ndarray | None
    top_logprobs: np.ndarray | None


class SpeculativeSampler(Wrapped):
    """Wraps the sampler: ``sample`` is the inner one's; ``draft`` and ``verify`` are added."""

    def __init__(self, inner, *, slots, uploader) -> None:
        super().__init__(inner)
        self.table = slots
        self.uploader = uploader

    def sample(self, logits, slots, device_steps=None, committed=None):
        return self.inner.sample(logits, slots, device_steps=device_steps, committed=committed)

    def _batch(self, slots: np.ndarray, offsets: np.ndarray):
        return build_sampling_batch(self.table, slots, self.uploader, step_offsets=offsets)

    @torch.inference_mode()
    def draft(self, logits: torch.Tensor, slots: np.ndarray, offsets: np.ndarray):
        """Draft tokens ``[M]`` from depth-d ``logits [M, vocab]`` and the draft distribution
        ``q [M, vocab]`` (None when every row is greedy: greedy verification needs no q)."""
        sb = self._batch(slots, offsets)
        z = suppressed_logits(logits, sb)
        greedy = z.argmax(dim=-1)
        if sb.all_greedy:
            return greedy, None
        scaled = sampling_logits(z, sb)
        lo, hi = _salted(sb, DRAFT_SALT)
        drawn = gumbel_argmax(scaled, uniform_noise(lo, hi, sb.step, z.shape[-1]))
        return torch.where(sb.temperature > 0, drawn, greedy), torch.softmax(scaled, dim=-1)

    def _judge(self, logits: torch.Tensor, sb, drafts: np.ndarray, q: torch.Tensor | None):
        """Per position: (raw fp32 logits, whether its draft is accepted, the token it emits: the
        draft if accepted, else the correction; positions without a draft (-1) emit a plain draw)."""
        dev = logits.device
        raw = logits.float()
        z = suppressed_logits(raw, sb)
        greedy = z.argmax(dim=-1)
        drafts_dev = drafts if torch.is_tensor(drafts) else to_device(drafts, dev)
        has_draft = drafts_dev >= 0
        accept = has_draft & (drafts_dev == greedy)
        emitted = greedy
        if not sb.all_greedy:
            p = torch.softmax(sampling_logits(z, sb), dim=-1)
            idx = drafts_dev.clamp_min(0)[:, None]
            px, qx = p.gather(1, idx).squeeze(1), q.gather(1, idx).squeeze(1)
            lo, hi = _salted(sb, ACCEPT_SALT)
            u = uniform_noise(lo, hi, sb.step, 1)[:, 0]
            accept_random = has_draft & (u * qx.double() < px.double())
            residual = (p - q).clamp_min(0.0)
            # p == q leaves no residual mass; a draw from p is then the right one
            residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
            corrected = gumbel_argmax(residual.log(), uniform_noise(sb.seed_lo, sb.seed_hi, sb.step, z.shape[-1]))
            random = sb.temperature > 0
            accept = torch.where(random, accept_random, accept)
            emitted = torch.where(random, torch.where(accept, drafts_dev, corrected), greedy)
        return raw, accept, emitted

    @staticmethod
    def _logprobs(sb, raw: torch.Tensor, tokens: torch.Tensor):
        """Logprobs of the raw full-depth distribution, as the base sampler reports them (device
        tensors, None where not asked for)."""
        lp = top_ids = top_lp = None
        if sb.max_logprobs >= 0:
            logp = torch.log_softmax(raw, dim=-1)
            lp = logp.gather(1, tokens[:, None]).squeeze(1)
            if sb.max_logprobs > 0:
                top_lp, top_ids = logp.topk(sb.max_logprobs, dim=-1)
        return lp, top_ids, top_lp

    @torch.inference_mode()
    def verify(self, logits: torch.Tensor, slots: np.ndarray, offsets: np.ndarray, row_of: np.ndarray,
               drafts: np.ndarray, q: torch.Tensor | None, num_rows: int) -> Verified:
        """Verify ``num_rows`` rows laid out flat: position j belongs to row ``row_of[j]``, stands
        for generation step ``offsets[j]`` past the slot's count, and checks draft ``drafts[j]``
        (-1 at each row's last position, which only yields a token); ``row_of`` is sorted. ``q``: the draft
        distribution at each position (rows of zeros at last positions), or None if all greedy."""
        sb = self._batch(slots, offsets)
        raw, accept, emitted = self._judge(logits, sb, drafts, q)
        dev = raw.device
        # Each row keeps its positions up to and including its first non-accepted one.
        n = len(row_of)
        local = np.arange(n) - np.searchsorted(row_of, row_of)
        first = torch.full((num_rows,), n, dtype=torch.int64, device=dev)
        first.scatter_reduce_(0, to_device(row_of, dev), torch.where(accept, n, to_device(local, dev)), reduce="amin")
        host = torch.cat([first + 1, emitted]).cpu().numpy()  # one readback: tokens per row, every position's token
        counts = host[:num_rows]
        keep = local < counts[row_of]
        lp = top_ids = top_lp = None
        if sb.max_logprobs >= 0:  # only then the kept positions' rows go back to the device
            at = to_device(np.nonzero(keep)[0], dev)
            lp, top_ids, top_lp = (None if t is None else t.cpu().numpy()
                                   for t in self._logprobs(sb, raw[at], emitted[at]))
        return Verified(counts, host[num_rows:][keep], lp, top_ids, top_lp)

    @torch.inference_mode()
    def check(self, logits: torch.Tensor, slots: np.ndarray, offsets: np.ndarray, drafts: torch.Tensor,
              q: torch.Tensor | None) -> Checked:
        """Check one draft per row (chain rows at full depth), on the device: row i's full-depth
        ``logits[i]`` stand for generation step ``offsets[i]`` and judge its draft ``drafts[i]``
        (a device tensor; made from ``q[i]``, or None if all greedy). Every row emits one token: its
        draft if accepted, else the correction. Nothing is read back here."""
        sb = self._batch(slots, offsets)
        raw, accept, emitted = self._judge(logits, sb, drafts, q)
        return Checked(accept, emitted, *self._logprobs(sb, raw, emitted))
