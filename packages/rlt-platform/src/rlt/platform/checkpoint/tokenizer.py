"""Tokenizer and chat template from a checkpoint directory.

``tokenizer.json`` is loaded with the ``tokenizers`` library; ``tokenizer_config.json`` supplies
the special tokens and the Jinja chat template, rendered in a sandboxed Jinja environment as
Hugging Face does (same whitespace options, ``loopcontrols``, and HF's ``{% generation %}`` block,
which Huginn's template uses to mark assistant text and which renders as its body; HF's ``tojson``
filter — no HTML escaping, keys in the given order — and ``strftime_now``; the special tokens
``bos_token`` / ``eos_token`` / ``unk_token`` / ``pad_token``, ``tools`` and ``documents`` unset). Template
variables pass through: ``enable_thinking`` of the Ouro Thinking and Nanbeige templates; Huginn's
template itself renders role ``assistant`` as ``Huginn``. Prompts rendered from a template are
encoded without adding special tokens.

``encode`` releases the GIL while it runs (the ``tokenizers`` batch path), so a long prompt
tokenised in a worker thread does not stall the other threads; text with a lone surrogate
(which Rust strings cannot hold) is an :class:`InvalidRequestError`, not a ``TypeError``.
``max_chars_per_token`` bounds how many characters one token can stand for, so a caller can
refuse text that cannot fit a context before tokenising it.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from rlt.platform.errors import CheckpointError, InvalidRequestError


_SURROGATE = re.compile("[\ud800-\udfff]")


def first_surrogate(text: str) -> int:
    """Index of the first lone surrogate in ``text`` (not valid Unicode text), or -1."""
    m = _SURROGATE.search(text)
    return -1 if m is None else m.start()


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
        self.unk_token = _token_text(config.get("unk_token"))
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self._template = None
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch
        self._max_chars = _max_chars_per_token(tokenizer)

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
        try:
            # the batch path runs without the GIL (plain encode holds it throughout)
            return self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:
            at = first_surrogate(text) if isinstance(text, str) else -1
            if at < 0:
                raise
            raise InvalidRequestError(f"prompt: has a lone surrogate (U+{ord(text[at]):04X}) at character {at}; "
                                      "text must be valid Unicode", param="prompt") from None

    @property
    def max_chars_per_token(self) -> int | None:
        """An upper bound on the characters of input text one token covers, or None when the
        tokenizer has no such bound (a fused unknown token, or a normalizer that may drop text).
        Text longer than ``n * max_chars_per_token`` characters has more than ``n`` tokens."""
        return self._max_chars

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

            def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                # HF's override: Jinja's own tojson escapes HTML characters and sorts keys
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        try:
            defaults = {"tools": None, "documents": None, "unk_token": self.unk_token, "pad_token": self.pad_token}
            return self._template.render({
                **defaults,
                **kwargs,
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token or "",
                "eos_token": self.eos_token or "",
            })
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequestError(f"chat template failed: {exc}") from None


#: normalizers that never make the text shorter (so characters per token stay bounded by the vocab)
_LENGTH_SAFE_NORMALIZERS = frozenset({"Prepend", "Lowercase", "NFD", "NFKD"})


def _max_chars_per_token(tokenizer: Tokenizer) -> int | None:
    try:
        spec = json.loads(tokenizer.to_str())
    except Exception:  # noqa: BLE001 - no bound rather than a failure
        return None
    model = spec.get("model") or {}
    kind = model.get("type")
    if kind not in ("BPE", "WordPiece", "WordLevel", "Unigram"):
        return None
    unk = model.get("unk_token", model.get("unk_id"))
    if kind in ("BPE", "Unigram") and model.get("fuse_unk", kind == "Unigram") and unk is not None:
        return None  # a run of unknown characters becomes one token
    norm = spec.get("normalizer")
    parts = [] if norm is None else (norm.get("normalizers") or [] if norm.get("type") == "Sequence" else [norm])
    if any((p or {}).get("type") not in _LENGTH_SAFE_NORMALIZERS for p in parts):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    # Byte-level vocabularies spell one byte per character, so this is bytes (>= characters) per
    # token; others spell the text itself (a byte-fallback token "<0xE2>" over-counts: still a bound).
    longest = max((len(t) for t in vocab), default=1)
    if kind == "WordPiece":  # an unknown word up to this many characters is one [UNK]
        longest = max(longest, int(model.get("max_input_chars_per_word") or 100))
    return max(1, longest)


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
