"""The offline ``LLM`` API: generate over prompts or token-id lists, outputs in input order.

The engine is composed with the installed features (:mod:`rlt.platform.composition`), as
``rlt-server serve`` does: ``features={"name": False}`` turns one off, ``{"name": Options(...)}``
configures one, and ``use_features=False`` gives the base engine.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Mapping, Sequence

from tqdm.auto import tqdm

from rlt.platform.config import EngineConfig
from rlt.platform.outputs import RequestOutput
from rlt.platform.sampling_params import SamplingParams

Prompt = str | Sequence[int]
log = logging.getLogger("rlt.llm")


def _split_feature_settings(features: Mapping[str, Any] | None) -> tuple[dict[str, bool], dict[str, Any]]:
    enabled, options = {}, {}
    for name, value in (features or {}).items():
        if isinstance(value, bool):
            enabled[name] = value
        else:
            enabled[name], options[name] = True, value
    return enabled, options


class LLM:
    def __init__(self, model: str | None = None, *, features: Mapping[str, Any] | None = None,
                 use_features: bool = True, **engine_options) -> None:
        self._init(EngineConfig(model=model, **engine_options), features, use_features)

    @classmethod
    def from_config(cls, config: EngineConfig, *, features: Mapping[str, Any] | None = None,
                    use_features: bool = True) -> "LLM":
        llm = cls.__new__(cls)
        llm._init(config, features, use_features)
        return llm

    @classmethod
    def from_engine(cls, engine) -> "LLM":
        """Wrap an engine that was composed elsewhere (``rlt-server generate``)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._ids = itertools.count()
        return llm

    def _init(self, config: EngineConfig, features, use_features: bool) -> None:
        from rlt.platform.composition import build_engine, format_feature_table

        enabled, options = _split_feature_settings(features)
        self.engine = build_engine(config, features=None if use_features else [], enabled=enabled, options=options)
        for line in format_feature_table(self.engine.features):
            log.info("%s", line)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        show = use_tqdm if use_tqdm is not None else len(prompts) >= 16
        with tqdm(total=len(ids), desc="generate", disable=not show, unit="req") as bar:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in ids:
                        done[out.request_id] = out
                        bar.update(1)
                if not self.engine.has_unfinished_requests() and len(done) < len(ids):
                    raise RuntimeError("engine went idle with requests unfinished")
        return [done[r] for r in ids]

    def chat(self, messages, sampling_params: SamplingParams | None = None, **template_kwargs) -> RequestOutput:
        text = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
        ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        return self.generate([ids], sampling_params, use_tqdm=False)[0]
