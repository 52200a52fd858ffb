"""What the engine returns per request: tokens, text, exit depths, finish reason and usage."""

from __future__ import annotations

import attrs


@attrs.frozen
class TokenLogprob:
    token_id: int
    logprob: float
    #: top alternatives as (token id, logprob), best first; empty unless requested.
    top: tuple[tuple[int, float], ...] = ()
    #: 1-based rank of ``token_id`` in the distribution (1 = the argmax); None where not computed.
    rank: int | None = None


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None


@attrs.frozen
class RequestOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    #: loops run to produce each generated token (the prompt's token: the prefill depth).
    exit_depths: tuple[int, ...]
    finished: bool
    #: None while running; then "stop" | "length" | "abort".
    finish_reason: str | None
    #: the stop string or stop token id that ended the request, if any.
    stop_reason: str | int | None
    logprobs: tuple[TokenLogprob, ...] | None
    #: tokens and text added since the previous output of this request.
    new_token_ids: tuple[int, ...]
    new_text: str
    metrics: RequestMetrics
    #: set when the request was aborted by an engine fault, with its message.
    error: str | None = None
    #: when ``prompt_logprobs`` was asked: one entry per prompt token, the first None (nothing
    #: predicts it); the same tuple on every output from the first on. None otherwise.
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    @property
    def usage(self) -> Usage:
        return Usage(len(self.prompt_token_ids), len(self.token_ids))
