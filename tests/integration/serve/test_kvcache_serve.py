"""rlt-kvcache under a real server: with a small KV pool, 64 concurrent streaming requests with
large max_tokens all complete, token-identical to the base engine offline, with preemptions
counted in /metrics; the startup feature table shows the policy; priority travels over HTTP."""

from __future__ import annotations

import asyncio

import openai

from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.engine.llm import LLM

from conftest import scrape, word_prompt

CLIENTS = 64
MAX_TOKENS = 32
#: 64 requests of ~10 + 32 positions need ~2,800 blocks with full reservation (4 planes, pages of 4)
SMALL_POOL = 400


async def _one(client: openai.AsyncOpenAI, i: int) -> dict:
    stream = await client.completions.create(
        model="tiny", prompt=word_prompt(i), max_tokens=MAX_TOKENS, temperature=0.8, seed=500 + i, stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True, "priority": i % 3})
    ids, finish = [], None
    async for chunk in stream:
        for c in chunk.choices:
            ids.extend(getattr(c, "token_ids", None) or [])
            finish = c.finish_reason or finish
    return {"ids": ids, "finish": finish}


async def _run_all(url: str) -> list:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        return await asyncio.gather(*(_one(client, i) for i in range(CLIENTS)), return_exceptions=True)


def test_small_pool_degrades_instead_of_failing(launch_server, tiny_model):
    server = launch_server("--model", str(tiny_model), "--served-model-name", "tiny", "--dtype", "float32",
                           "--num-kv-blocks", str(SMALL_POOL), "--max-num-seqs", "64", "--block-size", "4",
                           "--preemption", "--preemption-mode", "auto", "--prefix-cache", "--log-level", "warning",
                           "--max-num-batched-tokens", "64", "--prefill-chunk-size", "16")  # chunked prefill composes
    assert "policy=priority" in server.stdout  # the startup feature table shows the policy
    results = asyncio.run(_run_all(server.url))
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert all(r["finish"] == "length" and len(r["ids"]) == MAX_TOKENS for r in results)
    llm = LLM.from_config(EngineConfig(model=str(tiny_model), dtype="float32", block_size=4, max_num_seqs=64),
                          use_features=False)
    want = llm.generate([word_prompt(i) for i in range(CLIENTS)],
                        [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=500 + i, ignore_eos=True)
                         for i in range(CLIENTS)])
    for i, (got, w) in enumerate(zip(results, want)):
        assert got["ids"] == list(w.token_ids), i
    m = scrape(server.url)
    assert m['rlt:kv_preemptions_total{model_name="tiny"}'] > 0
    assert m['rlt:kv_resumed_total{model_name="tiny"}'] == m['rlt:kv_preemptions_total{model_name="tiny"}']
    swapped = m['rlt:kv_swapped_out_bytes_total{model_name="tiny"}']
    recomputed = m['rlt:kv_recompute_tokens_total{model_name="tiny"}']
    assert swapped > 0 or recomputed > 0
    assert 'rlt:prefix_cache_hit_rate{model_name="tiny"}' in m
    assert m['rlt:requests_total{model_name="tiny",outcome="length"}'] == CLIENTS
