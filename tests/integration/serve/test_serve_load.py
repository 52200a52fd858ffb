"""Bounded load: 64 concurrent streaming clients (completions and chat, sampled with seeds) all
finish without error, and each streamed output equals offline generation of the same prompt and
seed. One round, 64 requests of 8 tokens: bounded in count; every client has a timeout."""

from __future__ import annotations

import asyncio

import openai

from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.engine.llm import LLM

from conftest import TINY_ENGINE, word_prompt

CLIENTS = 64
MAX_TOKENS = 8


def _params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=1000 + i)


async def _one(client: openai.AsyncOpenAI, i: int) -> dict:
    common = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=1000 + i, stream=True,
                  stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
    text, ids, depths, finish, usage = [], [], [], None, None
    if i % 4 == 3:
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": word_prompt(i)}], **common)
    else:
        stream = await client.completions.create(prompt=word_prompt(i), **common)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text.append(c.delta.content or "" if i % 4 == 3 else c.text)
            ids.extend(getattr(c, "token_ids", None) or [])
            depths.extend((getattr(c, "rlt", None) or {}).get("exit_depths", []))
            finish = c.finish_reason or finish
    return {"text": "".join(text), "ids": ids, "depths": depths, "finish": finish, "usage": usage}


async def _run_all(url: str) -> list:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        return await asyncio.gather(*(_one(client, i) for i in range(CLIENTS)), return_exceptions=True)


def test_64_concurrent_streams_equal_offline_generation(tiny_server, tiny_model):
    results = asyncio.run(_run_all(tiny_server.url))
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    llm = LLM.from_config(EngineConfig(model=str(tiny_model), dtype="float32", **TINY_ENGINE))
    tok = llm.tokenizer
    prompts = []
    for i in range(CLIENTS):
        if i % 4 == 3:
            rendered = tok.apply_chat_template([{"role": "user", "content": word_prompt(i)}], add_generation_prompt=True)
            prompts.append(tok.encode(rendered, add_special_tokens=False))
        else:
            prompts.append(word_prompt(i))
    want = llm.generate(prompts, [_params(i) for i in range(CLIENTS)])
    for i, (got, w) in enumerate(zip(results, want)):
        assert got["ids"] == list(w.token_ids), i
        assert got["text"] == w.text, i
        assert got["depths"] == list(w.exit_depths), i
        assert got["finish"] == w.finish_reason, i
        assert got["usage"].prompt_tokens == len(w.prompt_token_ids)
        assert got["usage"].completion_tokens == len(w.token_ids)
