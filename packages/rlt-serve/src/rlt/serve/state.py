"""What the routes share: the front end, a tokenizer of its own, names, limits and metrics.

The front end keeps its own :class:`RltTokenizer` (loaded from the same checkpoint) so that
tokenisation and chat-template rendering never touch the engine thread's objects. Both run in a
small pool of worker threads of their own (tokenising releases the GIL), never on the event loop,
so ``/health`` and small requests keep being answered while long prompts are tokenised.

Prompt text is bounded before it is tokenised in full: text longer than ``max_model_len *
max_chars_per_token`` characters cannot fit the context and is refused at once; longer text than
a typical ``PROBE_CHARS_PER_TOKEN`` characters per token is first tokenised by growing prefixes,
and refused as soon as a prefix alone is over the context. The work for a prompt that cannot fit
is so bounded by the context length, not by the size of the body.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
from pydantic import BaseModel

from rlt.platform.checkpoint.tokenizer import RltTokenizer, first_surrogate
from rlt.platform.errors import InvalidRequestError
from rlt.serve.async_engine import AsyncEngine
from rlt.serve.errors import BadRequest, ModelNotFound
from rlt.serve.feature import HttpOptions
from rlt.serve.metrics import ServerMetrics

#: jinja variables the server passes itself; a request may not override them
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})
#: text longer than this many characters per context token is first tokenised by prefixes
PROBE_CHARS_PER_TOKEN = 8
#: a prefix must be this many tokens over the context before the whole is refused (cut effects)
PROBE_SLACK_TOKENS = 32
_WS = re.compile(r"\s")


def find_lone_surrogate(value: Any, path: str = "") -> tuple[str, int, str] | None:
    """The first string in a request (a pydantic model, dicts, lists) holding a lone surrogate:
    (field path such as ``messages.0.content``, index, the character), or None. Unknown fields of
    a model are searched only where the server uses them (``uses_extra_fields``, true unless the
    model says otherwise): an ignored field is never walked, however big."""
    stack = [(path, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            at = first_surrogate(v)
            if at >= 0:
                return where or "body", at, v[at]
        elif isinstance(v, BaseModel):
            items = [(k, getattr(v, k)) for k in type(v).model_fields]
            if v.model_extra and getattr(v, "uses_extra_fields", True):
                items += v.model_extra.items()
            stack.extend((f"{where}.{k}" if where else k, x) for k, x in reversed(items))
        elif isinstance(v, dict):
            for k, x in reversed(list(v.items())):
                key = f"{where}.{k}" if where else str(k)
                if isinstance(k, str) and first_surrogate(k) >= 0:
                    return where or "body", first_surrogate(k), k[first_surrogate(k)]
                stack.append((key, x))
        elif isinstance(v, (list, tuple)):
            if v and all(type(x) is int for x in v):
                continue
            stack.extend((f"{where}.{i}" if where else str(i), x) for i, x in reversed(list(enumerate(v))))
    return None


def check_text(body: Any) -> None:
    """400 naming the field when any text in the request is not valid Unicode (a lone surrogate,
    which JSON can spell as ``\\ud800`` but no tokenizer can take)."""
    bad = find_lone_surrogate(body)
    if bad is not None:
        where, at, ch = bad
        raise BadRequest(f"{where}: has a lone surrogate (U+{ord(ch):04X}) at character {at}; text must be valid "
                         "Unicode", where)


@attrs.define(eq=False)
class ServerState:
    engine: AsyncEngine
    tokenizer: RltTokenizer
    served_names: list[str]
    #: what to call the model in responses (a name, never a filesystem path)
    model_root: str
    max_model_len: int
    vocab_size: int
    options: HttpOptions
    metrics: ServerMetrics
    #: static description for GET /v1/engine (platform, attention, features, config)
    info: dict[str, Any]
    #: the checkpoint directory: for the startup log only, never in a response
    model_path: str = ""
    #: the API key in force (--api-key or $RLT_API_KEY), or None
    api_key: str | None = attrs.field(default=None, repr=False)
    #: model names accepted but never listed (the --model path when no name was given)
    aliases: list[str] = attrs.field(factory=list)
    created: int = attrs.field(factory=lambda: int(time.time()))
    _token_strs: dict[int, str] = attrs.field(factory=dict)
    _pool: ThreadPoolExecutor = attrs.field(
        factory=lambda: ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)),
                                           thread_name_prefix="rlt-tokenize"))

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    def check_model(self, name: str | None) -> str:
        """The model name to report; 404 for a name this server does not serve."""
        if name is None:
            return self.model_name
        if name in self.aliases:
            return self.model_name
        if name not in self.served_names:
            raise ModelNotFound(name, self.served_names)
        return name

    def token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_strs) < 65536:
                self._token_strs[token_id] = s
        return s

    def check_token_ids(self, ids: list[int], field: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(f"{field}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", field)

    def check_prompt_len(self, num_tokens: int, field: str) -> None:
        """400 for a prompt that leaves no room for one generated token (the engine's rule, checked
        here too so that an over-long prompt never reaches the engine thread)."""
        if num_tokens >= self.max_model_len:
            raise BadRequest(f"{field}: prompt has {num_tokens} tokens; this model's maximum context length is "
                             f"{self.max_model_len} tokens (prompt plus at least one generated token)", field)

    def check_fits(self, num_engine_requests: int, field: str) -> None:
        """400 (not a retryable 503) for a request that needs more engine requests than the server
        can ever hold at once."""
        cap = self.engine.capacity
        if num_engine_requests > cap:
            raise BadRequest(
                f"{field}: this request needs {num_engine_requests} generations (prompts x n) but this server runs at "
                f"most {cap} at once (--max-num-seqs + --max-queue-len); it can never be admitted: split it into "
                "smaller requests", field)

    async def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return await self._run(self.tokenizer.decode, ids, skip_special_tokens)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def encode(self, text: str, add_special_tokens: bool, field: str = "prompt") -> list[int]:
        """Tokenise ``text`` off the event loop; 400 naming ``field`` as soon as it is certain not to
        fit the context (so the work for such text is bounded by the context length)."""
        check_text({field: text})
        limit = self.max_model_len
        per_token = self.tokenizer.max_chars_per_token
        if per_token is not None and len(text) > limit * per_token:
            raise BadRequest(
                f"{field}: has {len(text)} characters, more than fit this model's maximum context length of {limit} "
                f"tokens (at most {limit * per_token} characters with this tokenizer)", field)
        probe = PROBE_CHARS_PER_TOKEN * limit
        while len(text) > probe:
            cut = probe
            ws = None
            for ws in _WS.finditer(text, max(0, probe - 256), probe):
                pass
            if ws is not None:  # cut at white space, where tokenizers split anyway
                cut = ws.start()
            ids = await self._tokenize(text[:cut], add_special_tokens, field)
            if len(ids) > limit + PROBE_SLACK_TOKENS:
                raise BadRequest(
                    f"{field}: is longer than this model's maximum context length of {limit} tokens (its first "
                    f"{cut} characters are already {len(ids)} tokens)", field)
            probe *= 4
        return await self._tokenize(text, add_special_tokens, field)

    async def _tokenize(self, text: str, add_special_tokens: bool, field: str) -> list[int]:
        try:
            return await self._run(self.tokenizer.encode, text, add_special_tokens)
        except InvalidRequestError as exc:  # a lone surrogate the checks above did not see
            raise BadRequest(str(exc).replace("prompt:", f"{field}:", 1), field) from None

    async def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                          continue_final_message: bool, template_kwargs: dict[str, Any] | None) -> str:
        kwargs = dict(template_kwargs or {})
        reserved = _RESERVED_TEMPLATE_VARS & set(kwargs)
        if reserved:
            raise BadRequest(f"chat_template_kwargs: may not set {', '.join(sorted(reserved))}", "chat_template_kwargs")
        per_token = self.tokenizer.max_chars_per_token
        if per_token is not None:
            chars = sum(len(m.get("content") or "") for m in messages)
            if chars > self.max_model_len * per_token:
                raise BadRequest(
                    f"messages: hold {chars} characters, more than fit this model's maximum context length of "
                    f"{self.max_model_len} tokens (at most {self.max_model_len * per_token} characters with this "
                    "tokenizer)", "messages")

        def render() -> str:
            try:
                return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                          **kwargs)
            except InvalidRequestError as exc:  # the template's own raise_exception, or no template
                raise BadRequest(str(exc), exc.param or "messages") from None
            except Exception as exc:  # noqa: BLE001 - user data fed to the checkpoint's template
                raise BadRequest(f"chat template failed on these messages: {type(exc).__name__}: {exc}",
                                 "messages") from None

        text = await self._run(render)
        if continue_final_message:
            final = messages[-1].get("content") or ""
            pos = text.rfind(final) if final else -1
            if pos < 0:
                raise BadRequest("continue_final_message: the final message's content does not appear in the "
                                 "rendered chat template", "continue_final_message")
            text = text[:pos + len(final)]
        return text
