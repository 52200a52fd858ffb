"""Request bodies of the OpenAI-compatible API (pydantic, through FastAPI), and their translation
into rlt's :class:`SamplingParams`.

Types are strict (a string is not a number, ``true`` is not an integer): a wrong type is a 400,
not a silent coercion. Ranges are checked once, by :class:`SamplingParams` (the engine's single
source of truth), not duplicated here. Unknown fields are accepted and ignored with a warning, as
vLLM does; fields rlt cannot honour (beam search, best_of, tools, ...) are accepted
only at their neutral value, otherwise they are a 400 that names the field — never silently
dropped.

This module builds no responses and touches no engine.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from rlt.platform.errors import InvalidRequestError
from rlt.platform.sampling_params import MAX_LOGPROBS, SamplingParams
from rlt.serve.errors import BadRequest, from_rlt_error

log = logging.getLogger("rlt.serve")
_U64 = 2**64

#: A normalised prompt: text, or token ids.
PromptItem = Union[str, list[int]]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    #: whether the server reads this model's unknown fields (else they are only warned about)
    uses_extra_fields: ClassVar[bool] = False
    #: fields the OpenAI API lets a client send as null, meaning their default (as vLLM reads them), where
    #: this model's type does not itself admit None
    NULL_MEANS_DEFAULT: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _nulls_to_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in cls.NULL_MEANS_DEFAULT):
            return {k: v for k, v in data.items() if not (v is None and k in cls.NULL_MEANS_DEFAULT)}
        return data

    def warn_unknown(self, endpoint: str) -> None:
        if self.model_extra:
            log.warning("%s: ignoring unknown field(s) %s", endpoint, ", ".join(sorted(self.model_extra)))


class StreamOptions(_Body):
    include_usage: bool = True
    continuous_usage_stats: bool = False


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_prompt_shape(value: Any) -> None:
    """ValueError unless ``value`` is ``str | list[str] | list[int] | list[list[int]]`` (non-empty lists)."""
    shape = "a string, a list of strings, a list of token ids, or a list of token-id lists"
    if isinstance(value, str):
        return
    if not isinstance(value, list):
        raise ValueError(f"must be {shape}")
    if not value:
        raise ValueError("must not be empty")
    if all(isinstance(v, str) for v in value) or all(_is_int(v) for v in value):
        return
    if all(isinstance(v, list) for v in value):
        for i, v in enumerate(value):
            if not v:
                raise ValueError(f"token-id list {i} is empty")
            if not all(_is_int(t) for t in v):
                raise ValueError(f"token-id list {i} must hold integers only")
        return
    raise ValueError(f"must be {shape}, not a mixture")


def prompt_items(value: Any) -> tuple[list[PromptItem], bool]:
    """A prompt value whose shape :func:`check_prompt_shape` passed -> (prompts, was_a_batch); its first
    item tells the shape."""
    if isinstance(value, str):
        return [value], False
    if isinstance(value[0], str):
        return list(value), True
    if isinstance(value[0], list):
        return [list(v) for v in value], True
    return [list(value)], False


#: Fields rlt accepts only at these values (OpenAI / vLLM defaults).
NEUTRAL_VALUES: dict[str, tuple] = {"use_beam_search": (False,)}


class SamplingFields(_Body):
    """Fields common to completions and chat completions."""

    NULL_MEANS_DEFAULT: ClassVar[tuple[str, ...]] = ("n", "stream", "echo", "logprobs")

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    #: OpenAI's: token id (as a string) -> bias added to its logit, clamped to [-100, 100]
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    # rlt's loop controls
    min_loops: int | None = None
    max_loops: int | None = None
    exit_threshold: float | None = None
    #: rlt extension: scale of a random initial state (Huginn; 0: the zero state, drawn from ``seed``)
    init_state_scale: float | None = None
    #: rlt extension: self-speculation {num_tokens, draft_loops} (needs rlt-spec's self_spec feature)
    speculation: dict[str, Any] | None = None
    #: rlt/vLLM extension: return generated (and prompt) token ids in each choice
    return_token_ids: bool = False
    #: vLLM extension: the logprob of every prompt token (the first is null), plus the top-k
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    user: str | None = None
    #: OpenAI's penalties in [-2, 2] and vLLM's repetition_penalty (> 0); null: off
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    # accepted only at their neutral values
    best_of: int | None = None
    use_beam_search: bool = False
    response_format: dict[str, Any] | None = None

    def check_supported(self, max_n: int) -> None:
        for name, neutral in NEUTRAL_VALUES.items():
            value = getattr(self, name)
            if value not in neutral:
                raise BadRequest(f"{name}: rlt does not support {name} (got {value!r}); leave it unset", name)
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest(f"best_of: rlt does not support best_of != n (got {self.best_of}); leave it unset",
                             "best_of")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise BadRequest("response_format: rlt supports only {\"type\": \"text\"}", "response_format")
        if not 1 <= self.n <= max_n:
            raise BadRequest(f"n: must be an integer in [1, {max_n}], got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options: only allowed when stream is true", "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise BadRequest("prompt_logprobs: not available when stream is true (as in vLLM)", "prompt_logprobs")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters; out-of-range values raise :class:`InvalidRequestError` (-> 400).

        ``prompt_logprobs`` is what the engine computes: the request's own field, or more where the
        endpoint needs them (completions' ``echo`` with ``logprobs``)."""
        stop = self.stop if self.stop is not None else ()
        kwargs: dict[str, Any] = dict(
            max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p, logit_bias=_token_keys(self.logit_bias),
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed, stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, priority=self.priority, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            min_loops=1 if self.min_loops is None else self.min_loops,
            max_loops=self.max_loops, exit_threshold=self.exit_threshold, speculation=self.speculation,
            init_state_scale=self.init_state_scale,
        )
        if kwargs["top_k"] == -1:
            kwargs["top_k"] = 0
        return SamplingParams(**kwargs)


def _token_keys(bias: dict[str, float] | None) -> dict[int, float]:
    """logit_bias' keys (token ids as JSON strings) as ints; a key that is not one is a 400 naming logit_bias."""
    out = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) <= 19):  # 19 digits: int64, and no giant int parse
            raise InvalidRequestError(f"logit_bias: keys must be token ids (non-negative integers as strings), "
                                      f"got {key!r}"[:300], "logit_bias")
        out[int(key)] = value
    return out


def seed_for_choice(seed: int | None, i: int) -> int | None:
    """Seed of choice ``i`` of ``n``: ``seed + i`` (kept in the 64-bit range); None stays random."""
    if seed is None:
        return None
    s = seed + i
    return s if s < _U64 else s - _U64


class CompletionRequest(SamplingFields):
    prompt: Any
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        check_prompt_shape(v)
        return v

    def prompts(self) -> tuple[list[PromptItem], bool]:
        return prompt_items(self.prompt)  # the shape was checked when the body was validated

    def check_supported(self, max_n: int) -> None:
        super().check_supported(max_n)
        if self.suffix:
            raise BadRequest("suffix: rlt does not support suffix (fill-in-the-middle); leave it unset", "suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"logprobs: must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")

    @property
    def echo_logprobs(self) -> bool:
        """``echo`` with ``logprobs``: the prompt's tokens come back with their logprobs (vLLM)."""
        return self.echo and self.logprobs is not None

    @property
    def prompt_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt comes back (with ``logprobs``, scored token by token) and
        nothing is generated — evaluation clients' scoring request, which vLLM accepts too. The engine computes
        one token, which the response leaves out (:meth:`rlt.serve.serving._Job.view`; vLLM instead counts it in
        usage and returns its id)."""
        return self.echo and self.max_tokens == 0

    def to_params(self) -> SamplingParams:
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens: 0 is allowed only with echo (the prompt returned, nothing "
                                      "generated); set max_tokens to at least 1, or echo to true", "max_tokens")
        if self.prompt_only and self.min_tokens > 0:
            raise InvalidRequestError(f"min_tokens: ({self.min_tokens}) must not exceed max_tokens (0)", "min_tokens")
        prompt_logprobs = None
        if self.echo_logprobs:
            prompt_logprobs = max(self.logprobs, self.prompt_logprobs or 0)
        return self.sampling_params(1 if self.prompt_only else self.max_tokens, self.logprobs, prompt_logprobs)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    #: a message's further fields go to the chat template
    uses_extra_fields: ClassVar[bool] = True

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"messages.{index}.content.{j}: rlt serves text only; each content part must be "
                                 f"{{\"type\": \"text\", \"text\": \"...\"}}", f"messages.{index}.content")
            parts.append(part["text"])
        return "".join(parts)

    def for_template(self, index: int) -> dict[str, Any]:
        msg: dict[str, Any] = dict(self.model_extra or {})
        msg["role"] = self.role
        msg["content"] = self.text(index)
        if self.name is not None:
            msg["name"] = self.name
        return msg


class ChatTemplateFields(_Body):
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None

    def check_template_fields(self) -> None:
        if not self.messages:
            raise BadRequest("messages: must hold at least one message", "messages")
        if self.chat_template is not None:
            raise BadRequest("chat_template: rlt applies the checkpoint's chat template only; leave it unset",
                             "chat_template")
        if self.continue_final_message and self.add_generation_prompt:
            raise BadRequest("continue_final_message: needs add_generation_prompt set to false",
                             "continue_final_message")
        reserved = {"messages", "add_generation_prompt"} & set(self.chat_template_kwargs or {})
        if reserved:
            raise BadRequest(f"chat_template_kwargs: may not set {', '.join(sorted(reserved))}", "chat_template_kwargs")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template(i) for i, m in enumerate(self.messages)]


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def check_supported(self, max_n: int) -> None:
        super().check_supported(max_n)
        self.check_template_fields()
        if self.tools:
            raise BadRequest("tools: rlt does not support tool calling; leave tools unset", "tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice: rlt does not support tool calling", "tool_choice")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise BadRequest("top_logprobs: needs logprobs set to true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise BadRequest(f"top_logprobs: must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                                 "top_logprobs")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise BadRequest(f"max_completion_tokens: must be an integer >= 1, got {self.max_completion_tokens}",
                             "max_completion_tokens")
        if self.max_completion_tokens is not None and self.max_tokens is not None:
            try:  # max_completion_tokens is the one used, but an invalid max_tokens is not ignored
                SamplingParams(max_tokens=self.max_tokens)
            except InvalidRequestError as exc:
                raise from_rlt_error(exc) from None

    def to_params(self) -> SamplingParams:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(limit, logprobs)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise BadRequest("give exactly one of prompt or messages", "prompt")
        if self.messages is not None and not self.messages:
            raise BadRequest("messages: must hold at least one message", "messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise BadRequest("continue_final_message: needs add_generation_prompt set to false",
                             "continue_final_message")


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]

