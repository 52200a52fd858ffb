"""Output processing: tokens a step produced -> request state and :class:`RequestOutput` values.

Appends each produced token with its exit depth and logprobs, detokenizes incrementally, applies
stop token ids (after ``min_tokens``), stop strings (the text is cut before the match; a match
found in a later token's text discards what follows) and ``max_tokens``, and builds incremental
outputs. Decides *that* a request finished and why; releasing its slot and KV is the core's job.
Host-only; runs on the engine thread.
"""

from __future__ import annotations

import time

from rlt.platform.engine import prompt_logprobs
from rlt.platform.engine.request import Request
from rlt.platform.outputs import RequestMetrics, RequestOutput, TokenLogprob


class OutputProcessor:
    def __init__(self, eos_token_ids: frozenset[int]) -> None:
        self.eos_token_ids = eos_token_ids

    def append(self, req: Request, token: int, depth: int, logprob: float | None, top, now: float) -> str | None:
        """Record one produced token; returns the finish reason if the request ends here."""
        req.output_token_ids.append(token)
        req.exit_depths.append(depth)
        if req.first_token_time is None:
            req.first_token_time = now
        if req.params.logprobs is not None:
            req.logprobs.append(TokenLogprob(token, float(logprob), top))
        delta = req.detok.push(token)
        n_out = len(req.output_token_ids)
        if token in req.stop_token_ids and n_out >= req.params.min_tokens:
            params_stop = token in req.params.stop_token_ids
            req.stop_reason = token if token not in self.eos_token_ids or params_stop else None
            return "stop"
        req.text = req.detok.text
        if req.params.stop and n_out >= req.params.min_tokens and delta:
            longest = max(map(len, req.params.stop))
            window_start = max(0, len(req.text) - len(delta) - longest + 1)
            hits = [(req.text.find(s, window_start), s) for s in req.params.stop]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, s = min(hits)
                req.text = req.text[:pos + len(s)] if req.params.include_stop_str_in_output else req.text[:pos]
                req.stop_reason = s
                return "stop"
        if n_out >= req.max_tokens:
            return "length"
        return None

    @staticmethod
    def finish(req: Request, reason: str) -> None:
        if req.finish_reason is None:
            req.finish_reason = reason
        if req.detok is not None and not isinstance(req.stop_reason, str):
            req.text = req.detok.text  # a stop string has already cut the text; keep that cut
        req.finished_time = time.monotonic()

    @staticmethod
    def output(req: Request, finished: bool) -> RequestOutput:
        new_ids = tuple(req.output_token_ids[req.reported_tokens:])
        new_text = req.text[req.reported_text:]
        req.reported_tokens = len(req.output_token_ids)
        req.reported_text = len(req.text)
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=tuple(req.prompt_token_ids),
            token_ids=tuple(req.output_token_ids),
            text=req.text,
            exit_depths=tuple(req.exit_depths),
            finished=finished,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=tuple(req.logprobs) if req.params.logprobs is not None else None,
            new_token_ids=new_ids,
            new_text=new_text,
            metrics=RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time, req.finished_time),
            error=req.error,
            prompt_logprobs=prompt_logprobs.reported(req),
        )
