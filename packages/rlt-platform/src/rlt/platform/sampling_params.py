"""Per-request sampling and depth parameters, validated at construction.

Defaults follow vLLM (temperature 1.0, top_p 1.0, top_k off, max_tokens 16). rlt adds the loop
controls: ``min_loops`` / ``max_loops`` bound the loops a generated token may run, and
``exit_threshold`` τ turns on adaptive exit (τ >= 1, the default, is fixed full depth).
``speculation`` asks for self-speculation (rlt-spec): drafts of ``num_tokens`` tokens with
``draft_loops`` loops; its model-dependent limits are checked by the feature that serves it.
"""

from __future__ import annotations

import math
import attrs

from rlt.platform.errors import InvalidRequestError
from rlt.platform.validation import check_seed, is_int

MAX_LOGPROBS = 20


def _fail(field: str, message: str):
    raise InvalidRequestError(f"{field}: {message}", field)


_is_int = is_int


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@attrs.frozen
class Speculation:
    """Per-request self-speculation: ``num_tokens`` drafts per round (0: none) made with
    ``draft_loops`` loops (None: the engine's default)."""

    num_tokens: int
    draft_loops: int | None = None

    def __attrs_post_init__(self) -> None:
        if not _is_int(self.num_tokens) or self.num_tokens < 0:
            _fail("speculation.num_tokens", f"must be an integer >= 0, got {self.num_tokens!r}")
        if self.draft_loops is not None and (not _is_int(self.draft_loops) or self.draft_loops < 1):
            _fail("speculation.draft_loops", f"must be an integer >= 1, got {self.draft_loops!r}")


def _speculation(value) -> Speculation | None:
    if value is None or isinstance(value, Speculation):
        return value
    if not isinstance(value, dict):
        _fail("speculation", f"must be an object {{num_tokens, draft_loops}}, got {value!r}")
    unknown = sorted(set(value) - {"num_tokens", "draft_loops"})
    if unknown:
        _fail("speculation", f"unknown field(s) {', '.join(unknown)} (allowed: num_tokens, draft_loops)")
    if "num_tokens" not in value:
        _fail("speculation.num_tokens", "is required")
    return Speculation(**value)


@attrs.frozen
class SamplingParams:
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    stop: tuple[str, ...] = attrs.field(
        default=(), converter=lambda s: (s,) if isinstance(s, str) else tuple(s or ())
    )
    ignore_eos: bool = False
    min_loops: int = 1
    max_loops: int | None = None
    exit_threshold: float | None = None
    priority: int = 0
    #: None: no logprobs; 0: the chosen token's logprob; k: also the top-k alternatives.
    logprobs: int | None = None
    #: None: no prompt logprobs; 0: each prompt token's own logprob; k: also the top-k alternatives.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    #: keep the stop string that ended the request at the end of the text (vLLM's option).
    include_stop_str_in_output: bool = False
    #: self-speculation for this request (a :class:`Speculation` or a dict of its fields)
    speculation: Speculation | None = attrs.field(default=None, converter=_speculation)

    def __attrs_post_init__(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _fail("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            _fail("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not _is_num(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            _fail("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _is_num(self.top_p) or not (0.0 < self.top_p <= 1.0):
            _fail("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            _fail("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        check_seed(self.seed)
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                _fail("stop_token_ids", f"must be non-negative integers, got {t!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                _fail("stop", f"stop strings must be non-empty strings, got {s!r}")
        if not _is_int(self.min_loops) or self.min_loops < 1:
            _fail("min_loops", f"must be an integer >= 1, got {self.min_loops!r}")
        if self.max_loops is not None and (not _is_int(self.max_loops) or self.max_loops < self.min_loops):
            _fail("max_loops", f"must be an integer >= min_loops ({self.min_loops}), got {self.max_loops!r}")
        if self.exit_threshold is not None and (
            not _is_num(self.exit_threshold) or not (0.0 <= self.exit_threshold <= 1.0)
        ):
            _fail("exit_threshold", f"must be in [0, 1], got {self.exit_threshold!r}")
        if not _is_int(self.priority):
            _fail("priority", f"must be an integer, got {self.priority!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            _fail("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            _fail("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            _fail("include_stop_str_in_output", f"must be a boolean, got {self.include_stop_str_in_output!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_(self, **changes) -> "SamplingParams":
        return attrs.evolve(self, **changes)

