"""The offline ``LLM`` API: generate over prompts or token-id lists, outputs in input order."""

from __future__ import annotations

import itertools
from typing import Sequence

from tqdm.auto import tqdm

from rlt.platform.config import EngineConfig
from rlt.platform.engine.engine import LLMEngine
from rlt.platform.outputs import RequestOutput
from rlt.platform.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        llm._ids = itertools.count()
        return llm

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
