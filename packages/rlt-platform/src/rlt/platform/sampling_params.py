"""Per-request sampling and depth parameters, validated at construction.

Defaults follow vLLM (temperature 1.0, top_p 1.0, top_k off, max_tokens 16). rlt adds the loop
controls: ``min_loops`` / ``max_loops`` bound the loops a generated token may run, and
``exit_threshold`` τ turns on adaptive exit (τ >= 1, the default, is fixed full depth).

Every numeric field is checked against the range of the column the engine stores it in (its
slot table: ``top_k``, ``min_tokens``, stop token ids and logprobs are int64, loop bounds int32,
``temperature`` / ``top_p`` / ``exit_threshold`` float32), so a value that passes here can never
fail later while the engine writes it; an out-of-range value raises :class:`InvalidRequestError`
whose ``param`` names the field. Counts of stop strings and stop token ids are bounded too: each
is checked on every generated token.
``logit_bias`` adds a value in [-100, 100] to chosen tokens' logits before sampling (greedy rows too),
as the OpenAI API does; vLLM clamps larger values into that range, and so does rlt.
``presence_penalty`` / ``frequency_penalty`` (in [-2, 2], 0 = off) subtract from a token's logit once if it
was generated / once per time it was generated; ``repetition_penalty`` (> 0, 1 = off) divides the positive
logits and multiplies the negative ones of tokens in the prompt or the output — vLLM's definitions and order
(``rlt.platform.engine.penalties``). A penalised request does not speculate (rlt-spec).
``init_state_scale`` scales the random initial state of models that have one (Huginn).
``speculation`` asks for self-speculation (rlt-spec): drafts of ``num_tokens`` tokens with
``draft_loops`` loops; its model-dependent limits are checked by the feature that serves it.
"""

from __future__ import annotations

import math
import attrs

from rlt.platform.errors import InvalidRequestError
from rlt.platform.validation import check_seed, is_int

MAX_LOGPROBS = 20
#: the most stop strings / stop token ids one request may give (each is checked per generated token)
MAX_STOP_STRINGS = 256
MAX_STOP_TOKEN_IDS = 1024
#: the most tokens one request's ``logit_bias`` may name (its slot-table row is that wide)
MAX_LOGIT_BIAS = 1024
#: logit_bias values are clamped into [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT] (the OpenAI API's range)
LOGIT_BIAS_LIMIT = 100.0
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
#: the largest finite float32 (temperature and top_p are float32 on the device)
FLOAT32_MAX = 3.4028234663852886e38
#: the penalties and their off values
PENALTIES_OFF = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
#: the smallest normal float32 (repetition_penalty divides logits on the device: it must not round to 0)
FLOAT32_TINY = 1.1754943508222875e-38


def _fail(field: str, message: str):
    raise InvalidRequestError(f"{field}: {message}", param=field)


_is_int = is_int


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(v) -> bool:
    """A number that is not NaN or infinite (a Python int always is, however large: no float overflow)."""
    return _is_num(v) and (isinstance(v, int) or math.isfinite(v))


def _int_in(field: str, value, low: int, high: int, what: str | None = None) -> None:
    if not _is_int(value) or not low <= value <= high:
        _fail(field, f"must be {what or f'an integer in [{low}, {high}]'}, got {value!r}")


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


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """``{token_id: bias}`` (or pairs) -> sorted ``((token_id, bias), ...)``, biases clamped to +-100; bad
    entries raise naming ``logit_bias``. (Ids are checked against the vocabulary at admission.)"""
    if not value:
        return ()
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = [(t, b) for t, b in items]
    except (TypeError, ValueError):
        _fail("logit_bias", f"must map token ids to numbers, got {value!r}"[:300])
    if len(pairs) > MAX_LOGIT_BIAS:
        _fail("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}")
    out = {}
    for t, b in pairs:
        if not _is_int(t) or not 0 <= t <= INT64_MAX:
            _fail("logit_bias", f"keys must be token ids (non-negative integers), got {t!r}")
        if not _finite(b):
            _fail("logit_bias", f"values must be finite numbers, got {b!r} for token {t}"[:300])
        out[t] = float(min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, b)))
    return tuple(sorted(out.items()))


@attrs.frozen
class SamplingParams:
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    #: drop tokens less likely than ``min_p`` times the most likely one (after temperature; 0 = off), as vLLM
    min_p: float = 0.0
    #: added to the named tokens' logits before sampling: ``{token_id: bias}`` in, sorted pairs kept
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_logit_bias)
    #: subtracted from the logit of every token already generated (vLLM / OpenAI; 0 = off)
    presence_penalty: float = 0.0
    #: subtracted once per time a token was generated (vLLM / OpenAI; 0 = off)
    frequency_penalty: float = 0.0
    #: tokens of the prompt or the output: positive logits divided by it, negative ones multiplied (1 = off)
    repetition_penalty: float = 1.0
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
    #: scale of a random initial state (Huginn; None: the engine's --init-state-scale; 0: the zero
    #: state). The state is drawn from the request's ``seed``, so it never depends on the batch.
    init_state_scale: float | None = None

    def __attrs_post_init__(self) -> None:
        if self.max_tokens is not None:
            _int_in("max_tokens", self.max_tokens, 1, INT64_MAX, f"an integer in [1, {INT64_MAX}]")
        _int_in("min_tokens", self.min_tokens, 0, INT64_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if (not _finite(self.temperature)
                or not 0 <= self.temperature <= FLOAT32_MAX):
            _fail("temperature", f"must be a finite number in [0, {FLOAT32_MAX:.4g}] (0 = greedy), "
                                 f"got {self.temperature!r}")
        if not _is_num(self.top_p) or not (0.0 < self.top_p <= 1.0):
            _fail("top_p", f"must be in (0, 1], got {self.top_p!r}")
        _int_in("top_k", self.top_k, -1, INT64_MAX, f"-1 or 0 (off), or a positive integer up to {INT64_MAX}")
        if not _is_num(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            _fail("min_p", f"must be in [0, 1] (0 = off), got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_num(value) or not -2.0 <= value <= 2.0:
                _fail(name, f"must be in [-2, 2] (0 = off), got {value!r}")
        if not _is_num(self.repetition_penalty) or not FLOAT32_TINY <= self.repetition_penalty <= FLOAT32_MAX:
            _fail("repetition_penalty", f"must be a number > 0 (1 = off; a normal float32: in [{FLOAT32_TINY:.4g}, "
                                        f"{FLOAT32_MAX:.4g}]), got {self.repetition_penalty!r}")
        check_seed(self.seed)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _fail("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t <= INT64_MAX:
                _fail("stop_token_ids", f"must be non-negative integers, got {t!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            _fail("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                _fail("stop", f"stop strings must be non-empty strings, got {s!r}")
        _int_in("min_loops", self.min_loops, 1, INT32_MAX)
        if self.max_loops is not None and (not _is_int(self.max_loops)
                                           or not self.min_loops <= self.max_loops <= INT32_MAX):
            _fail("max_loops", f"must be an integer in [min_loops ({self.min_loops}), {INT32_MAX}], "
                               f"got {self.max_loops!r}")
        if self.exit_threshold is not None and (
            not _is_num(self.exit_threshold) or not (0.0 <= self.exit_threshold <= 1.0)
        ):
            _fail("exit_threshold", f"must be in [0, 1], got {self.exit_threshold!r}")
        _int_in("priority", self.priority, INT64_MIN, INT64_MAX)
        if self.logprobs is not None:
            _int_in("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int_in("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if self.init_state_scale is not None and (
            not _finite(self.init_state_scale)
            or not 0 <= self.init_state_scale <= FLOAT32_MAX
        ):
            _fail("init_state_scale", f"must be a finite number >= 0 (0 = the zero state), got {self.init_state_scale!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            _fail("include_stop_str_in_output", f"must be a boolean, got {self.include_stop_str_in_output!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalties_on(self) -> tuple[str, ...]:
        """The names of the repetition / frequency / presence penalties not at their off value."""
        return tuple(name for name, off in PENALTIES_OFF.items() if getattr(self, name) != off)

    @property
    def penalized(self) -> bool:
        return bool(self.penalties_on)

    def with_(self, **changes) -> "SamplingParams":
        return attrs.evolve(self, **changes)

