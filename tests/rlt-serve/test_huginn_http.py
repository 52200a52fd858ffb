"""Huginn-0125 over HTTP: the chat template renders the assistant as ``Huginn``, chat and
completions answer with the oracle's tokens at the request's ``max_loops`` (recurrences) and
``init_state_scale``, generation stops on Huginn's own stop tokens (``<|end_text|>``,
``<|end_turn|>``) with ``finish_reason: stop``, and bad Huginn fields are 400s naming the field
while the engine keeps serving."""

from __future__ import annotations

import pytest
import torch
from starlette.testclient import TestClient

from rlt.platform import EngineConfig, LLMEngine
from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.features import FeatureStatus
from rlt.platform.models.huginn_reference import huginn_reference_generate
from rlt.serve.app import create_app
from rlt.serve.feature import HttpOptions
from rlt.serve.routes import router
from rlt.serve.server import build_state


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint(family="huginn_raven", seed=5)


@pytest.fixture(scope="module")
def reference(path):
    ck = load_checkpoint(path, dtype=torch.float32)
    return ck.family.build_reference(ck.config, ck.weights)


@pytest.fixture(scope="module")
def client(path):
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=512, max_num_seqs=4,
                                    num_loops=8))
    status = FeatureStatus("http", "rlt-serve", True, True, True, "enabled")
    state = build_state(engine, statuses=[status], options=HttpOptions(), served_names=["huginn"])
    with TestClient(create_app(state, [router]), raise_server_exceptions=False) as c:
        yield c


def _ids(client, **body):
    r = client.post("/tokenize", json={"model": "huginn", **body})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _special(client, text):
    (tid,) = _ids(client, prompt=text, add_special_tokens=False)
    return tid


SPECIALS = ("<|begin_text|>", "<|end_text|>", "<|begin_header|>", "<|end_header|>", "<|end_turn|>", "<|pad|>")
MESSAGES = [{"role": "user", "content": "Ouro is a looped model"}]


def test_chat_template_renders_the_assistant_as_huginn(client):
    prompt = _ids(client, messages=MESSAGES, add_generation_prompt=True)
    text = client.post("/detokenize", json={"model": "huginn", "tokens": prompt}).json()["prompt"]
    assert text.endswith("<|begin_header|>Huginn<|end_header|>\n\n")
    assert "<|begin_header|>user<|end_header|>\n\nOuro is a looped model" in text


@pytest.mark.parametrize("loops,scale,seed", [(None, 0.0, None), (1, 0.0, None), (6, 0.5, 11)])
def test_chat_answers_with_the_oracles_tokens(client, reference, loops, scale, seed):
    prompt = _ids(client, messages=MESSAGES, add_generation_prompt=True)
    body = {"model": "huginn", "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "init_state_scale": scale}
    if loops is not None:
        body["max_loops"] = loops
    if seed is not None:
        body["seed"] = seed
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    want = huginn_reference_generate(reference, prompt, max_tokens=5, num_steps=loops or 3, seed=seed or 0,
                                     init_scale=scale)
    assert r.json()["usage"]["completion_tokens"] == 5
    specials = {_special(client, t) for t in SPECIALS}  # skipped in the answer's text, as in vLLM
    assert r.json()["choices"][0]["message"]["content"] == _text(client, [t for t in want if t not in specials])


def _text(client, ids):
    return client.post("/detokenize", json={"model": "huginn", "tokens": ids}).json()["prompt"]


def test_completions_stop_on_huginns_stop_tokens(client, reference):
    """Find a prompt whose greedy continuation reaches <|end_turn|> or <|end_text|> (random weights),
    then serve it: the answer ends there with finish_reason "stop", the stop token not in the text."""
    stops = {_special(client, "<|end_text|>"), _special(client, "<|end_turn|>")}
    found = None
    for a in range(6, 200):
        prompt = [a, (a * 7) % 300 + 6, (a * 13) % 300 + 6]
        out = huginn_reference_generate(reference, prompt, max_tokens=8, num_steps=3, stop_token_ids=tuple(stops))
        if out[-1] in stops and len(out) >= 2:
            found = prompt, out
            break
    assert found is not None, "no prompt of the search reaches a stop token; widen the search"
    prompt, out = found
    r = client.post("/v1/completions", json={"model": "huginn", "prompt": prompt, "max_tokens": 8,
                                              "temperature": 0, "init_state_scale": 0.0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == len(out)
    assert choice["text"] == _text(client, out[:-1])


@pytest.mark.parametrize("field,value", [("max_loops", 9), ("max_loops", 0), ("init_state_scale", -1.0),
                                         ("init_state_scale", "big")])
def test_bad_huginn_fields_are_400_and_the_engine_keeps_serving(client, field, value):
    r = client.post("/v1/completions", json={"model": "huginn", "prompt": [7, 8, 9], "max_tokens": 2,
                                              field: value})
    assert r.status_code == 400, r.text
    assert field in (r.json()["error"]["param"] or "") or field in r.json()["error"]["message"]
    ok = client.post("/v1/completions", json={"model": "huginn", "prompt": [7, 8, 9], "max_tokens": 2,
                                               "ignore_eos": True, "init_state_scale": 0.0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
