"""Tokenizer and chat template from a checkpoint directory.

``tokenizer.json`` is loaded with the ``tokenizers`` library; ``tokenizer_config.json`` supplies
the special tokens and the Jinja chat template, rendered in a sandboxed Jinja environment as
Hugging Face does (same whitespace options, ``loopcontrols``, and HF's ``{% generation %}`` block,
which Huginn's template uses to mark assistant text and which renders as its body). Template
variables pass through: ``enable_thinking`` of the Ouro Thinking and Nanbeige templates; Huginn's
template itself renders role ``assistant`` as ``Huginn``. Prompts rendered from a template are
encoded without adding special tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from rlt.platform.errors import CheckpointError, InvalidRequestError


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: HF marks assistant tokens with it; rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class RltTokenizer:
    def __init__(self, tokenizer: Tokenizer, config: dict[str, Any]) -> None:
        self._tok = tokenizer
        self.config = config
        self.chat_template: str | None = config.get("chat_template")
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token = _token_text(config.get("bos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self._template = None

    @classmethod
    def from_dir(cls, path: str | Path) -> "RltTokenizer":
        root = Path(path)
        tj = root / "tokenizer.json"
        if not tj.is_file():
            raise CheckpointError(f"{tj} not found: rlt needs tokenizer.json next to the weights")
        try:
            tok = Tokenizer.from_file(str(tj))
        except Exception as exc:  # tokenizers raises a plain Exception on parse errors
            raise CheckpointError(f"cannot load {tj}: {exc}") from None
        cfg: dict[str, Any] = {}
        tc = root / "tokenizer_config.json"
        if tc.is_file():
            try:
                cfg = json.loads(tc.read_text())
            except json.JSONDecodeError as exc:
                raise CheckpointError(f"{tc} is not valid JSON: {exc}") from None
        jt = root / "chat_template.jinja"
        if "chat_template" not in cfg and jt.is_file():
            cfg["chat_template"] = jt.read_text()
        return cls(tok, cfg)

    def describe(self) -> dict[str, Any]:
        """``tokenizer_config.json`` with special tokens as plain strings (what vLLM's ``/tokenizer_info``
        serves): no added-token table, the chat template included."""
        info = {k: (_token_text(v) if k.endswith("_token") else v) for k, v in self.config.items()
                if k != "added_tokens_decoder"}
        info.update(eos_token=self.eos_token, bos_token=self.bos_token, pad_token=self.pad_token,
                    chat_template=self.chat_template)
        info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        return info

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; use a completion prompt instead")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols])

            def raise_exception(message):
                raise jinja2.exceptions.TemplateError(message)

            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequestError(f"chat template failed: {exc}") from None


class IncrementalDetokenizer:
    """Streams text for a growing token list without re-decoding the whole sequence.

    Keeps a short window (``prefix`` .. ``read``) so multi-byte characters split over tokens are
    emitted only once complete (the replacement character marks an incomplete tail).
    """

    def __init__(self, tokenizer: RltTokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids or [])[-6:]
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        full = self.tok.decode(self.ids[self.prefix:], self.skip)
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            delta = full[len(prefix_text):]
            self.prefix, self.read = self.read, len(self.ids)
            self.text += delta
            return delta
        return ""
