"""What the routes share: the front end, a tokenizer of its own, names, limits and metrics.

The front end keeps its own :class:`RltTokenizer` (loaded from the same checkpoint) so that
tokenisation and chat-template rendering never touch the engine thread's objects.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import attrs

from rlt.platform.checkpoint.tokenizer import RltTokenizer
from rlt.platform.errors import InvalidRequestError
from rlt.serve.async_engine import AsyncEngine
from rlt.serve.errors import BadRequest, ModelNotFound
from rlt.serve.feature import HttpOptions
from rlt.serve.metrics import ServerMetrics

#: jinja variables the server passes itself; a request may not override them
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


@attrs.define(eq=False)
class ServerState:
    engine: AsyncEngine
    tokenizer: RltTokenizer
    served_names: list[str]
    model_root: str
    max_model_len: int
    vocab_size: int
    options: HttpOptions
    metrics: ServerMetrics
    #: static description for GET /v1/engine (platform, attention, features, config)
    info: dict[str, Any]
    created: int = attrs.field(factory=lambda: int(time.time()))
    _token_strs: dict[int, str] = attrs.field(factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    def check_model(self, name: str | None) -> str:
        """The model name to report; 404 for a name this server does not serve."""
        if name is None:
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

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)

    async def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                          continue_final_message: bool, template_kwargs: dict[str, Any] | None) -> str:
        kwargs = dict(template_kwargs or {})
        reserved = _RESERVED_TEMPLATE_VARS & set(kwargs)
        if reserved:
            raise BadRequest(f"chat_template_kwargs: may not set {', '.join(sorted(reserved))}", "chat_template_kwargs")

        def render() -> str:
            try:
                return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                          **kwargs)
            except InvalidRequestError:  # the template's own raise_exception, or no template
                raise
            except Exception as exc:  # noqa: BLE001 - user data fed to the checkpoint's template
                raise BadRequest(f"chat template failed on these messages: {type(exc).__name__}: {exc}",
                                 "messages") from None

        text = await asyncio.to_thread(render)
        if continue_final_message:
            final = messages[-1].get("content") or ""
            pos = text.rfind(final) if final else -1
            if pos < 0:
                raise BadRequest("continue_final_message: the final message's content does not appear in the "
                                 "rendered chat template", "continue_final_message")
            text = text[:pos + len(final)]
        return text
