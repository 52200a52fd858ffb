"""Host-side state of one request: its resolved parameters, what it produced, its lifecycle.

Not here: where the request is in its computation (its rows are values the scheduler policy owns,
:class:`rlt.platform.engine.interfaces.Row`), and device state (hidden states, exit accumulators:
the executor owns them per slot).
"""

from __future__ import annotations

import enum
import time

import attrs

from rlt.platform.checkpoint.tokenizer import IncrementalDetokenizer
from rlt.platform.outputs import TokenLogprob
from rlt.platform.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@attrs.define(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    #: resolved limits
    max_tokens: int
    max_loops: int
    min_loops: int
    exit_threshold: float
    stop_token_ids: frozenset[int]
    arrival_index: int
    #: sampling seed (the request's own, or drawn from the engine's RNG when it gave none)
    seed: int = 0
    #: scale of the random initial state (models with one, Huginn; drawn from ``seed``); 0: zero state
    init_state_scale: float = 0.0
    arrival_time: float = attrs.field(factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    slot: int = -1
    output_token_ids: list[int] = attrs.field(factory=list)
    exit_depths: list[int] = attrs.field(factory=list)
    logprobs: list[TokenLogprob] = attrs.field(factory=list)
    #: prompt logprobs so far (see engine/prompt_logprobs.py); a tuple once complete
    prompt_logprobs: list[TokenLogprob | None] | tuple = attrs.field(factory=lambda: [None])
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    detok: IncrementalDetokenizer | None = None
    text: str = ""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    #: bookkeeping for incremental outputs
    reported_tokens: int = 0
    reported_text: int = 0
    #: tokens sampled on the device by launched steps whose values the host has not read yet (a
    #: pipelined step loop reads them with a lag); they count as produced for positions and seeds
    num_pending: int = 0
    #: names of features holding per-request state across steps that preemption cannot save (an open
    #: speculative round: its drafts and draft hidden states): a preempting scheduler policy skips
    #: the request while this is not empty
    preemption_holds: set[str] = attrs.field(factory=set)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_produced(self) -> int:
        """Tokens produced so far: recorded ones plus those still in flight (``num_pending``)."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions ``[start, end)`` without concatenating prompt and output."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def max_positions(self) -> int:
        """Positions whose KV this request can ever write (the last sampled token never enters KV)."""
        return self.num_prompt + self.max_tokens - 1
