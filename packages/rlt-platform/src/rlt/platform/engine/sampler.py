"""Token sampling, vectorised over the batch.

Greedy rows take the argmax. Random rows use the Gumbel-max trick with counter-based noise: the
noise for (request seed, generation step, vocabulary id) is a hash, so a seeded request draws the
same tokens whatever else is in the batch, on any device, with no per-request generator objects.
Requests without a seed get a random one at admission. ``logit_bias`` is added to the logits first,
min_tokens suppresses the request's stop tokens until it has produced enough tokens, then the
repetition / frequency / presence penalties apply (``penalties.py``) — greedy rows take the argmax of
these logits; random rows then apply temperature, min-p, top-k and top-p (vLLM's order).

Logprobs are of the raw model distribution (log-softmax of the logits before temperature and
filtering), as vLLM reports them by default.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from rlt.platform.engine.penalties import PenaltyBatch, PenaltyState, apply_penalties, penalty_arrays

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (lowbias32) on int64 lanes holding values < 2**32."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform_noise(seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0,1) noise ``[M, vocab]`` determined by (seed, step, vocab id) only."""
    ids = torch.arange(vocab, device=seed_lo.device, dtype=torch.int64)[None, :]
    x = _mix32(seed_lo[:, None] ^ _mix32(seed_hi[:, None] + 0x9E3779B9))
    x = _mix32(x ^ _mix32(step[:, None] * 0x85EBCA6B + 0x632BE5AB))
    x = _mix32(x ^ _mix32(ids + 0x27D4EB2F))
    return (x.double() + 0.5) / 4294967296.0


@attrs.frozen(eq=False)
class SamplingBatch:
    """Per-row sampling parameters of the rows that sample this step (device tensors).

    When every row is greedy (``all_greedy``) only ``suppress`` and the biases are uploaded: a greedy
    row is the argmax of its biased, suppressed logits, and the random-row fields are None (nothing
    reads them).
    """

    temperature: torch.Tensor | None  # [M] fp32; 0 = greedy
    top_p: torch.Tensor | None  # [M] fp32
    top_k: torch.Tensor | None  # [M] int64; 0 = off
    min_p: torch.Tensor | None  # [M] fp32; 0 = off
    seed_lo: torch.Tensor | None  # [M] int64
    seed_hi: torch.Tensor | None  # [M] int64
    step: torch.Tensor | None  # [M] int64, tokens generated so far
    suppress: torch.Tensor | None  # [M, S] int64 token ids to ban (-1 = none), or None
    bias_ids: torch.Tensor | None  # [M, B] int64 logit_bias token ids (-1 = none), or None when no row has any
    bias_vals: torch.Tensor | None  # [M, B] fp32 their biases
    all_greedy: bool
    any_top: bool
    any_min_p: bool
    max_logprobs: int  # -1: none requested
    #: repetition / frequency / presence penalties with the rows' token history, or None when no row has
    #: any (or the batch was built without the history: rlt-spec's rows, which never have any)
    penalties: PenaltyBatch | None = None


@attrs.frozen(eq=False)
class SampleResult:
    token_ids: torch.Tensor  # [M] int64
    logprobs: torch.Tensor | None  # [M] fp32 chosen-token logprob
    top_ids: torch.Tensor | None  # [M, K]
    top_logprobs: torch.Tensor | None  # [M, K]


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp_max(vocab), torch.full_like(top_k, vocab))
    rank = torch.arange(vocab, device=logits.device)[None, :]
    drop = rank >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    drop |= before >= top_p[:, None]
    drop[:, 0] = False
    filtered = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, filtered)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """-inf where a token's probability is below ``min_p`` times the row's largest: in logits,
    ``z < max(z) + log(min_p)`` (min_p 0: log 0 = -inf keeps every token; 1: only the most likely)."""
    floor = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
    return logits.masked_fill(logits < floor, float("-inf"))


def suppressed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``logits`` (float32) plus each row's ``logit_bias``, with its suppressed tokens (min_tokens) set
    to -inf, penalised: what greedy rows take the argmax of."""
    logits = logits.float()
    if batch.bias_ids is not None:
        ids = batch.bias_ids
        logits = logits.scatter_add(1, ids.clamp_min(0), torch.where(ids >= 0, batch.bias_vals, 0.0))
    if batch.suppress is not None:
        ban = batch.suppress.clamp_min(0)
        banned = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ban, batch.suppress >= 0)
        logits = logits.masked_fill(banned, float("-inf"))
    if batch.penalties is not None:
        logits = apply_penalties(logits, batch.penalties)
    return logits


def sampling_logits(suppressed: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits random rows draw from: temperature-scaled, then min-p, top-k and top-p filtered
    (-inf outside). Their softmax is the distribution :func:`sample` draws a random row's token from."""
    scaled = suppressed / batch.temperature.clamp_min(1e-6)[:, None]
    if batch.any_min_p:
        scaled = _apply_min_p(scaled, batch.min_p)
    if batch.any_top:
        scaled = _apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
    return scaled


def gumbel_argmax(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """argmax of ``logits + Gumbel(u)`` in float64: a draw from ``softmax(logits)`` given U(0,1) ``u``."""
    return (logits.double() - torch.log(-torch.log(u))).argmax(dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
    """Sample one token per row of ``logits [M, vocab]`` (float32)."""
    raw = logits.float()
    logits = suppressed_logits(raw, batch)
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        tokens = greedy
    else:
        u = uniform_noise(batch.seed_lo, batch.seed_hi, batch.step, logits.shape[-1])
        drawn = gumbel_argmax(sampling_logits(logits, batch), u)
        tokens = torch.where(batch.temperature > 0, drawn, greedy)
    lp = top_ids = top_lp = None
    if batch.max_logprobs >= 0:
        logp = torch.log_softmax(raw, dim=-1)
        lp = logp.gather(1, tokens[:, None]).squeeze(1)
        if batch.max_logprobs > 0:
            top_lp, top_ids = logp.topk(batch.max_logprobs, dim=-1)
    return SampleResult(tokens, lp, top_ids, top_lp)


def split_seed(seed: int) -> tuple[int, int]:
    s = seed % 2**64
    return s & _M32, s >> 32


def argmax_only(table, slots: np.ndarray) -> bool:
    """Whether every row of ``slots`` samples the argmax of its raw fp32 logits now and at any later
    generation step (a feature's fused heads may then skip :func:`sample`): greedy, no logprobs,
    no logit_bias, no penalties, and past min_tokens (no stop-token suppression)."""
    return bool((table.temperature[slots] == 0).all() and (table.logprobs[slots] < 0).all()
                and (table.bias_len[slots] == 0).all() and not table.penalized[slots].any()
                and (table.min_tokens[slots] <= table.num_generated[slots]).all())


def build_sampling_batch(table, slots: np.ndarray, uploader, step_offsets: np.ndarray | None = None,
                         device_steps: torch.Tensor | None = None, history: PenaltyState | None = None) -> SamplingBatch:
    """Gather the sampling parameters of ``slots`` from the host slot table (no per-row Python).

    ``step_offsets``: per row, how many tokens past the slot's generated count the row samples
    (speculation samples several future positions of one request in one call); default 0.
    ``device_steps``: per row, the generated count as a device tensor (int64), where only the
    device knows it (rows whose earlier exits the host has not read: rlt-decode's device-planned
    steps); the slot table's count is then a lower bound, used only to skip the min_tokens
    suppression when every row is past it. ``history``: the penalties' token history; with it, a
    step with a penalised row gets its ``penalties`` (parameters in the same one upload)."""
    temp = table.temperature[slots]
    top_p = table.top_p[slots]
    top_k = table.top_k[slots]
    min_p = table.min_p[slots]
    generated = table.num_generated[slots]
    if step_offsets is not None:
        generated = generated + step_offsets
    all_greedy = bool((temp == 0).all())
    any_min_p = not all_greedy and bool((min_p > 0).any())
    arrays = {} if all_greedy else {"temperature": temp, "top_p": top_p, "top_k": top_k,
                                    "seed_lo": table.seed_lo[slots], "seed_hi": table.seed_hi[slots]}
    if any_min_p:  # read only then (sampling_logits)
        arrays["min_p"] = min_p
    if not all_greedy and device_steps is None:
        arrays["step"] = generated
    if table.stop_ids.shape[1]:
        min_tokens = table.min_tokens[slots]
        needs = generated < min_tokens
        if needs.any():
            ids = table.stop_ids[slots].copy()
            if device_steps is None:
                ids[~needs] = -1
            else:
                arrays["min_tokens"] = min_tokens
            arrays["suppress"] = ids
    penalised = history is not None and bool(table.penalized[slots].any())
    if penalised:  # in the same one upload
        arrays.update(penalty_arrays(table, slots))
    width = int(table.bias_len[slots].max()) if len(slots) else 0
    if width:  # only as many columns as the step's widest logit_bias (one wide request never taxes the rest)
        arrays["bias_ids"], arrays["bias_vals"] = table.bias_ids[slots, :width], table.bias_vals[slots, :width]
    dev = uploader.upload(arrays) if arrays else {}  # greedy decoding: usually nothing to upload
    step, suppress = dev.get("step"), dev.get("suppress")
    if device_steps is not None:
        step = None if all_greedy else device_steps
        if suppress is not None:  # stop ids banned on the rows still below min_tokens (decided on the device)
            suppress = torch.where((device_steps < dev["min_tokens"])[:, None], suppress, -1)
    lp = table.logprobs[slots]
    return SamplingBatch(
        temperature=dev.get("temperature"), top_p=dev.get("top_p"), top_k=dev.get("top_k"), min_p=dev.get("min_p"),
        seed_lo=dev.get("seed_lo"), seed_hi=dev.get("seed_hi"), step=step, suppress=suppress,
        bias_ids=dev.get("bias_ids"), bias_vals=dev.get("bias_vals"),
        all_greedy=all_greedy, any_top=bool(((top_k > 0) | (top_p < 1.0)).any()),
        any_min_p=any_min_p,
        max_logprobs=int(lp.max()) if len(lp) else -1,
        penalties=history.gather(dev) if penalised else None,
    )


class TokenSampler:
    """The base :class:`Sampler`: parameters from the slot table, one upload, :func:`sample`; owns the
    per-slot token history of penalised requests (:class:`PenaltyState`; a sampler without a ``penalties``
    attribute makes the engine refuse penalised requests)."""

    def __init__(self, *, slots, uploader, vocab_size: int, device: torch.device) -> None:
        self.slots = slots
        self.uploader = uploader
        self.penalties = PenaltyState(slots, vocab_size, device)

    @classmethod
    def from_context(cls, ctx) -> "TokenSampler":
        return cls(slots=ctx.parts.slots, uploader=ctx.parts.uploader, vocab_size=ctx.shape.vocab_size,
                   device=ctx.device)

    def sample(self, logits: torch.Tensor, slots: np.ndarray, device_steps: torch.Tensor | None = None,
               committed: torch.Tensor | None = None) -> SampleResult:
        """``device_steps``: the rows' generated counts where only the device knows them
        (:func:`build_sampling_batch`); ``committed``: bool ``[M]`` on the device, the rows whose token
        is produced (None: every row) — a step whose exits only the device knows samples every row."""
        batch = build_sampling_batch(self.slots, slots, self.uploader, device_steps=device_steps,
                                     history=self.penalties)
        out = sample(logits, batch)
        if batch.penalties is not None:
            self.penalties.commit(batch.penalties, out.token_ids, committed)
        return out
