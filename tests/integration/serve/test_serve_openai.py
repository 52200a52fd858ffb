"""The OpenAI-compatible API over real HTTP, driven by the official ``openai`` client: completions,
chat, streaming, usage, n > 1, batched and token-id prompts, logprobs, echo, stop strings, rlt's
loop controls and exit depths — each compared with offline generation on the same checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.engine.llm import LLM

from conftest import TINY_ENGINE

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM.from_config(EngineConfig(model=str(tiny_model), dtype="float32", **TINY_ENGINE))


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].owned_by == "rlt"
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


#: characters that str.splitlines and httpx's aiter_lines treat as line breaks
LINE_BREAKS = "a\u2028b\u2029c\u0085d"


def test_streamed_line_separators_parse_in_every_client(client, tiny_server, tmp_path):
    body = {"model": "tiny", "prompt": LINE_BREAKS, "max_tokens": 2, "echo": True, "stream": True}
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body, timeout=60) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    texts = [c["text"] for e in events[:-1] for c in json.loads(e)["choices"]]
    assert "".join(texts).startswith(LINE_BREAKS)
    stream = client.completions.create(model="tiny", prompt=LINE_BREAKS, max_tokens=2, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices).startswith(LINE_BREAKS)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(LINE_BREAKS + "\n")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_bench.py"), "--base-url", tiny_server.url,
                        "--prompt-file", str(prompts), "--num-prompts", "2", "--output-len", "2",
                        "--extra-body", '{"echo": true}', "--result-file", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(out.read_text())["completed"] == 2


def test_completion_matches_offline_and_counts_usage(client, offline):
    r = client.completions.create(model="tiny", prompt="Hello world", max_tokens=6, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    want = offline.generate(["Hello world"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    c = r.choices[0]
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "tiny"
    assert c.text == want.text and c.token_ids == list(want.token_ids) and c.finish_reason == "length"
    assert c.prompt_token_ids == list(want.prompt_token_ids)
    assert c.rlt == {"exit_depths": list(want.exit_depths)}
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(want.prompt_token_ids), 6, len(want.prompt_token_ids) + 6)


def test_streaming_completion_equals_non_streaming(client):
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0.8, seed=5,
              extra_body={"return_token_ids": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert [t for c in content for t in c.choices[0].token_ids] == whole.choices[0].token_ids
    assert [d for c in content for d in c.choices[0].rlt["exit_depths"]] == whole.choices[0].rlt["exit_depths"]
    assert content[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_raw_sse_framing(tiny_server):
    body = {"prompt": "Hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])


def test_chat_uses_the_template_and_its_kwargs(client, offline):
    msgs = [{"role": "user", "content": "What is a loop?"}]
    for kwargs in ({}, {"enable_thinking": True}):
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0,
                                           extra_body={"chat_template_kwargs": kwargs, "return_token_ids": True})
        want = offline.chat(msgs, SamplingParams(max_tokens=5, temperature=0), **kwargs)
        c = r.choices[0]
        assert r.object == "chat.completion" and c.message.role == "assistant"
        assert c.message.content == want.text and c.token_ids == list(want.token_ids)
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    # enable_thinking adds "<think>\n" to the prompt
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1).usage.prompt_tokens
    thinking = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert thinking.usage.prompt_tokens > plain


def test_streaming_chat(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0.7, seed=3)
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0.7,
                                                 seed=3, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 6


def test_n_choices_sample_with_seed_plus_i(client, offline):
    r = client.completions.create(model="tiny", prompt="Numbers:", n=3, max_tokens=5, temperature=1.0, seed=40,
                                  extra_body={"return_token_ids": True})
    want = offline.generate(["Numbers:"] * 3, [SamplingParams(max_tokens=5, seed=40 + i) for i in range(3)])
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.token_ids for c in r.choices] == [list(w.token_ids) for w in want]
    assert r.usage.prompt_tokens == len(want[0].prompt_token_ids)  # the prompt counts once
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in want)


def test_streaming_n_choices_interleave_by_index(client):
    kw = dict(model="tiny", prompt="Numbers:", n=2, max_tokens=5, temperature=1.0, seed=7)
    whole = client.completions.create(**kw)
    texts = {0: "", 1: ""}
    finished = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finished == {0: "length", 1: "length"}


def test_batched_and_token_id_prompts(client, offline):
    r = client.completions.create(model="tiny", prompt=[[5, 6, 7], [9, 10]], n=2, max_tokens=3, temperature=0,
                                  extra_body={"return_token_ids": True})
    want = offline.generate([[5, 6, 7], [9, 10]], SamplingParams(max_tokens=3, temperature=0))
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.token_ids for c in r.choices] == [list(want[0].token_ids)] * 2 + [list(want[1].token_ids)] * 2
    assert r.usage.prompt_tokens == 5
    texts = client.completions.create(model="tiny", prompt=["a b", "c d e"], max_tokens=2)
    assert len(texts.choices) == 2


def test_logprobs_and_echo(client):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0, logprobs=2, echo=True)
    c = r.choices[0]
    assert c.text.startswith("Hello")
    lp = c.logprobs
    n = r.usage.prompt_tokens + 3  # echo: the prompt's tokens too, as vLLM returns them
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) >= 2 for t in lp.top_logprobs[1:])
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 2 and all(len(t.top_logprobs) == 3 for t in content)


def test_stop_strings_and_stop_tokens(client):
    kw = dict(model="tiny", prompt="The fox", max_tokens=12, temperature=1.0, seed=1)
    base = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True})
    text, ids = base.choices[0].text, base.choices[0].token_ids
    # a two-character ASCII stop string taken from the middle of this fixed checkpoint's sampled text
    stop = next((text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isalnum()),
                None)
    assert stop is not None, repr(text)
    r = client.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == stop
    assert r.choices[0].text == text[:text.find(stop)]
    streamed = client.completions.create(**kw, stop=[stop], stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    r = client.completions.create(**kw, extra_body={"ignore_eos": True, "stop_token_ids": [ids[2]],
                                                    "return_token_ids": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == ids[2]
    assert r.choices[0].token_ids == ids[:ids.index(ids[2]) + 1]


def test_loop_controls_reach_the_engine(client):
    r = client.completions.create(model="tiny", prompt="Loop", max_tokens=4, temperature=0,
                                  extra_body={"max_loops": 2, "min_loops": 1})
    assert r.choices[0].rlt["exit_depths"] == [2, 2, 2, 2]
    adaptive = client.completions.create(model="tiny", prompt="Loop", max_tokens=4, temperature=0,
                                         extra_body={"exit_threshold": 0.0, "min_loops": 3})
    # the first token comes from the prompt's prefill, which runs at full depth; then tau = 0 exits at min_loops
    assert adaptive.choices[0].rlt["exit_depths"] == [4, 3, 3, 3]


def test_min_tokens_priority_and_unknown_fields(client):
    r = client.completions.create(model="tiny", prompt="x", max_tokens=4,
                                  extra_body={"min_tokens": 4, "priority": -1, "some_future_field": 1})
    assert r.usage.completion_tokens == 4
