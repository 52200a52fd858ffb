"""Prompt logprobs: the log-probability of every prompt token under the model, at the depth the
request runs its prompt (its ``max_loops``), as vLLM's ``prompt_logprobs`` reports them.

Position ``p``'s final hidden state predicts token ``p + 1``, so a prompt chunk covering positions
``[s, s + L)`` scores prompt tokens ``s + 1 .. s + L`` (the token after the prompt's last position
is the first generated one: the sampler's business). The first prompt token has no prediction and
is reported as None.

The LM head runs over a chunk's positions in slices of ``chunk_size``, so a long prompt never
holds more than ``chunk_size x vocab`` logits at once. The numerics are the sampler's: fp32
log-softmax of the raw logits (no temperature, no filtering).

This module owns the computation and the bookkeeping; the engine says which rows want it
(:func:`prompt_logprob_jobs`), the executor runs it when a prompt chunk exits
(:func:`prompt_logprobs_for_batch`), and the engine collects the entries per request
(:func:`collect`, :func:`reported`).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from rlt.platform.outputs import TokenLogprob

#: positions per LM-head call: bounds the transient logits to ``chunk_size x vocab`` floats.
DEFAULT_CHUNK_SIZE = 256

#: batch row index -> (top-k, the prompt token ids this chunk's positions predict)
Jobs = dict[int, tuple[int, list[int]]]


def prompt_logprobs_for_chunk(model, hidden_chunk: torch.Tensor, token_ids: list[int], k: int,
                              chunk_size: int = DEFAULT_CHUNK_SIZE) -> list[TokenLogprob]:
    """Logprob (with rank and top-``k``) of ``token_ids[j]`` under the logits of ``hidden_chunk[j]``.

    ``hidden_chunk`` is ``[>= len(token_ids), hidden]``: the exited hidden states of consecutive
    positions, each predicting the next token.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    n = len(token_ids)
    if n > hidden_chunk.shape[0]:
        raise ValueError(f"{n} target tokens but only {hidden_chunk.shape[0]} hidden states")
    targets = torch.tensor(token_ids, dtype=torch.int64, device=hidden_chunk.device)
    out: list[TokenLogprob] = []
    for a in range(0, n, chunk_size):
        b = min(n, a + chunk_size)
        logp = torch.log_softmax(model.coda(hidden_chunk[a:b]).float(), dim=-1)
        lp = logp.gather(1, targets[a:b, None])
        rank = (logp > lp).sum(dim=-1) + 1
        lp_host, rank_host = lp.squeeze(1).cpu().tolist(), rank.cpu().tolist()
        if k > 0:
            top_lp, top_ids = logp.topk(k, dim=-1)
            tops = [tuple(zip(i, v)) for i, v in zip(top_ids.cpu().tolist(), top_lp.cpu().tolist())]
        else:
            tops = [()] * (b - a)
        out.extend(TokenLogprob(t, v, top, r)
                   for t, v, top, r in zip(token_ids[a:b], lp_host, tops, rank_host))
    return out


def prompt_logprob_jobs(rows: Iterable) -> Jobs:
    """The prompt rows (batch order) that want prompt logprobs, by row index (empty targets left out)."""
    jobs: Jobs = {}
    for i, row in enumerate(rows):
        k = row.request.params.prompt_logprobs
        if k is None or not row.in_prompt:
            continue
        targets = row.request.prompt_token_ids[row.start + 1:row.end + 1]
        if targets:
            jobs[i] = (k, targets)
    return jobs


def prompt_logprobs_for_batch(model, hidden: torch.Tensor, row_token_start: np.ndarray, exited: np.ndarray,
                              jobs: Jobs, chunk_size: int = DEFAULT_CHUNK_SIZE) -> dict[int, list[TokenLogprob]]:
    """Entries of every job row that exited this step, by row index. ``hidden``: the step's packed output."""
    out = {}
    for i, (k, targets) in jobs.items():
        if not exited[i]:
            continue
        start = int(row_token_start[i])
        out[i] = prompt_logprobs_for_chunk(model, hidden[start:start + len(targets)], targets, k, chunk_size)
    return out


def collect(req, entries: list[TokenLogprob] | None) -> None:
    """Append one exited chunk's entries to ``req.prompt_logprobs`` (which starts as ``[None]``)."""
    if entries:
        req.prompt_logprobs.extend(entries)


def reported(req) -> tuple[TokenLogprob | None, ...] | None:
    """What an output of ``req`` carries: the whole prompt's entries once they are all in, else None."""
    if req.params.prompt_logprobs is None or len(req.prompt_logprobs) < req.num_prompt:
        return None
    if not isinstance(req.prompt_logprobs, tuple):
        req.prompt_logprobs = tuple(req.prompt_logprobs)  # frozen once complete: shared by later outputs
    return req.prompt_logprobs
