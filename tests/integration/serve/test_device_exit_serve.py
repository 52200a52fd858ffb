"""``rlt-server serve --pipeline-device-exit`` over HTTP: 24 concurrent streaming clients with
adaptive exit (per-request exit_threshold, min_loops, seeds) get exactly what offline generation
gives; ``/v1/engine`` reports the device-planned steps it ran."""

from __future__ import annotations

import asyncio

import httpx
import openai

from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.engine.llm import LLM

from conftest import word_prompt

CLIENTS = 24
MAX_TOKENS = 12


def _extra(i: int) -> dict:
    return {"exit_threshold": (0.5, 0.7, 0.9)[i % 3], "min_loops": 1 + i % 2, "return_token_ids": True}


def _temperature(i: int) -> float:
    return 0.0 if i % 2 else 0.8


async def _one(client: openai.AsyncOpenAI, i: int) -> dict:
    stream = await client.completions.create(model="tiny", prompt=word_prompt(i), max_tokens=MAX_TOKENS,
                                             temperature=_temperature(i), seed=500 + i, stream=True,
                                             extra_body=_extra(i))
    ids, depths, finish = [], [], None
    async for chunk in stream:
        for c in chunk.choices:
            ids.extend(getattr(c, "token_ids", None) or [])
            depths.extend((getattr(c, "rlt", None) or {}).get("exit_depths", []))
            finish = c.finish_reason or finish
    return {"ids": ids, "depths": depths, "finish": finish}


async def _run_all(url: str) -> list:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        return await asyncio.gather(*(_one(client, i) for i in range(CLIENTS)), return_exceptions=True)


def test_adaptive_streams_equal_offline(launch_server, tiny_model):
    server = launch_server("--model", str(tiny_model), "--served-model-name", "tiny", "--dtype", "float32",
                           "--max-num-seqs", "32", "--pipeline-device-exit", "--log-level", "warning")
    results = asyncio.run(_run_all(server.url))
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    llm = LLM.from_config(EngineConfig(model=str(tiny_model), dtype="float32", max_num_seqs=32))
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=_temperature(i), seed=500 + i,
                             exit_threshold=_extra(i)["exit_threshold"], min_loops=_extra(i)["min_loops"])
              for i in range(CLIENTS)]
    want = llm.generate([word_prompt(i) for i in range(CLIENTS)], params)
    for i, (got, w) in enumerate(zip(results, want)):
        assert (got["ids"], got["depths"], got["finish"]) == (list(w.token_ids), list(w.exit_depths),
                                                               w.finish_reason), i
    info = httpx.get(f"{server.url}/v1/engine").json()["engine"]["executor"]["pipeline"]["device_exit"]
    assert info["enabled"] and info["open_steps"] > 0 and info["device_planned_steps"] > 0, info
