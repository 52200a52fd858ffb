"""rlt-spec under a real server: ``speculation`` in the request body (the rlt extension) on a server
with overlapped self-speculation — concurrent streaming and non-streaming greedy requests are
token-identical to plain decoding offline (the server composes rlt-decode's static buffers,
pipeline and, here on CPU, no graphs: chains are read back lagged); bad speculation objects and
speculation on a server without the feature are 400s naming the field, and the server keeps serving."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.engine.llm import LLM

from conftest import scrape
from test_serve_errors import check_error

MAX_TOKENS = 20


def _prompt(i: int) -> str:
    words = ["loop", "depth", "token", "the", "fox", "batch", "exit", "gate"]
    return " ".join(words[(i * 3 + k) % len(words)] for k in range(2 + i % 5))


@pytest.fixture(scope="module")
def spec_server(launch_server, tiny_model):
    return launch_server("--model", str(tiny_model), "--served-model-name", "tiny", "--dtype", "float32",
                         "--num-kv-blocks", "2048", "--max-num-seqs", "8", "--block-size", "4",
                         "--self-spec", "--async-self-spec", "--no-self-spec-adaptive", "--log-level", "warning")


async def _one(client: openai.AsyncOpenAI, i: int) -> list[int]:
    body = {"return_token_ids": True, "ignore_eos": True,
            "speculation": {"num_tokens": 1 + i % 4, "draft_loops": 1 + i % 3}}
    if i % 2:  # streaming
        stream = await client.completions.create(model="tiny", prompt=_prompt(i), max_tokens=MAX_TOKENS,
                                                 temperature=0.0, stream=True, extra_body=body)
        ids = []
        async for chunk in stream:
            for c in chunk.choices:
                ids.extend(getattr(c, "token_ids", None) or [])
        return ids
    r = await client.completions.create(model="tiny", prompt=_prompt(i), max_tokens=MAX_TOKENS, temperature=0.0,
                                        extra_body=body)
    return list(r.choices[0].token_ids)


async def _all(url: str, n: int) -> list:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        return await asyncio.gather(*(_one(client, i) for i in range(n)), return_exceptions=True)


def test_speculating_requests_over_http_equal_plain_decoding(spec_server, tiny_model):
    n = 12
    got = asyncio.run(_all(spec_server.url, n))
    errors = [g for g in got if isinstance(g, BaseException)]
    assert not errors, errors[:3]
    llm = LLM.from_config(EngineConfig(model=str(tiny_model), dtype="float32", block_size=4), use_features=False)
    want = llm.generate([_prompt(i) for i in range(n)],
                        [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)] * n)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == list(w.token_ids), i
    info = httpx.get(f"{spec_server.url}/v1/engine", timeout=30).json()
    assert info["stats"]["engine_description_live"]
    steps = info["engine"]["executor"]["steps"]  # as of now, not the startup snapshot
    assert steps.get("lagged_with_feature_rows", 0) > 0, steps  # chains read back lagged
    m = scrape(spec_server.url)  # the speculation counters on /metrics
    label = '{model_name="tiny"}'
    drafted, accepted = m[f"rlt:spec_draft_tokens_total{label}"], m[f"rlt:spec_accepted_tokens_total{label}"]
    assert drafted > 0 and 0 <= accepted <= drafted and m[f"rlt:spec_rounds_total{label}"] > 0
    assert 0.0 <= m[f"rlt:spec_acceptance{label}"] <= 1.0


@pytest.mark.parametrize("speculation,extra,param", [
    ({"num_tokens": 99}, {}, "speculation.num_tokens"),  # above --self-spec-max-num-tokens
    ({"num_tokens": 2, "draft_loops": 9}, {}, "speculation.draft_loops"),  # not below the model's loops
    ({"num_tokens": 2, "loops": 1}, {}, "speculation"),  # unknown field
    ({"num_tokens": -1}, {}, "speculation.num_tokens"),
    ({"num_tokens": 2}, {"exit_threshold": 0.5}, "speculation"),  # adaptive exit
], ids=["too-many", "too-deep", "unknown-field", "negative", "adaptive-exit"])
def test_bad_speculation_is_a_400_naming_the_field(spec_server, speculation, extra, param):
    r = httpx.post(f"{spec_server.url}/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": "loop depth", "max_tokens": 4, "speculation": speculation, **extra})
    err = check_error(r, 400, param)
    assert "speculation" in err["message"]
    ok = httpx.post(f"{spec_server.url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "loop depth", "max_tokens": 4, "speculation": {"num_tokens": 2}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None


def test_speculation_without_the_feature_is_a_400(tiny_server):
    r = httpx.post(f"{tiny_server.url}/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": "loop depth", "max_tokens": 4, "speculation": {"num_tokens": 2}})
    check_error(r, 400, "speculation")
