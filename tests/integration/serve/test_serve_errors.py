"""Every bad input over real HTTP gets the right status and the OpenAI error shape — never a 500 —
and the server stays healthy and correct afterwards."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import scrape

C, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
MSG = [{"role": "user", "content": "hi"}]

# (path, raw body or JSON value, expected status, expected param or None)
CASES = [
    (C, b'{"prompt": "Hel', 400, None),  # malformed JSON
    (C, b"", 400, None),  # no body
    (C, [1, 2], 400, None),  # not an object
    (C, {}, 400, "prompt"),  # missing field
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": ""}, 400, None),  # empty prompt
    (C, {"prompt": [1, "a"]}, 400, "prompt"),
    (C, {"prompt": [[1], []]}, 400, "prompt"),
    (C, {"prompt": [10**6]}, 400, "prompt"),  # token id outside the vocabulary
    (C, {"prompt": [-1]}, 400, "prompt"),
    (C, {"prompt": "word " * 300}, 400, None),  # longer than max_model_len (256)
    (C, {"prompt": "x", "max_tokens": 400}, 400, None),  # prompt + max_tokens > max_model_len
    (C, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    (C, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "x", "top_p": 2.0}, 400, "top_p"),
    (C, {"prompt": "x", "top_k": -5}, 400, "top_k"),
    (C, {"prompt": "x", "seed": 2**70}, 400, "seed"),
    (C, {"prompt": "x", "seed": 1.5}, 400, "seed"),
    (C, {"prompt": "x", "n": 0}, 400, "n"),
    (C, {"prompt": "x", "n": 1000}, 400, "n"),
    (C, {"prompt": "x", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens"),
    (C, {"prompt": "x", "stop": 7}, 400, "stop"),
    (C, {"prompt": "x", "stop": [""]}, 400, "stop"),
    (C, {"prompt": "x", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    (C, {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    (C, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {"prompt": "x", "min_loops": 0}, 400, "min_loops"),
    (C, {"prompt": "x", "max_loops": 9}, 400, None),  # more loops than the engine has
    (C, {"prompt": "x", "min_loops": 3, "max_loops": 2}, 400, "max_loops"),
    (C, {"prompt": "x", "exit_threshold": 1.5}, 400, "exit_threshold"),
    (C, {"prompt": "x", "priority": "high"}, 400, "priority"),
    (C, {"prompt": "x", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    (C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {"prompt": "x", "logit_bias": {"99999999": 5}}, 400, "logit_bias"),  # outside the vocabulary
    (C, {"prompt": "x", "logit_bias": {"x": 5}}, 400, "logit_bias"),
    (C, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    (C, {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"content": "no role"}]}, 400, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages.0.content"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "top_logprobs": 3}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": 2}, 400, "logprobs"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    (CHAT, {"messages": MSG, "chat_template_kwargs": {"eos_token": "x"}}, 400, "chat_template_kwargs"),
    (CHAT, {"messages": MSG, "chat_template_kwargs": "yes"}, 400, "chat_template_kwargs"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 300}]}, 400, None),
    (CHAT, {"messages": MSG, "model": "other"}, 404, "model"),
    (TOK, {}, 400, None),
    (TOK, {"prompt": 3}, 400, "prompt"),
    (DETOK, {"tokens": ["a"]}, 400, "tokens.0"),
    (DETOK, {"tokens": [10**6]}, 400, "tokens"),
    (DETOK, {"tokens": [1], "model": "x"}, 404, "model"),
]


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=30) as c:
        yield c


def check_error(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    assert err["type"] == {400: "BadRequestError", 404: "NotFoundError", 413: "PayloadTooLargeError",
                           503: "ServiceUnavailableError"}[status]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("path, body, status, param", CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)])
def test_bad_input(http, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=content, headers={"content-type": "application/json"})
    check_error(r, status, param)
    if path in (C, CHAT) and isinstance(body, dict) and "stream" not in body and "stream_options" not in body:
        # the same request streaming fails the same way, before the stream starts
        check_error(http.post(path, json={**body, "stream": True}), status, param)


def test_oversized_body_is_413(http):
    r = http.post(C, content=json.dumps({"prompt": "x" * 70000}), headers={"content-type": "application/json"})
    err = check_error(r, 413)
    assert "65536" in err["message"]


def test_messages_say_what_to_change(http):
    err = check_error(http.post(C, json={"prompt": "x", "max_tokens": 400}), 400)
    assert "maximum context length is 256" in err["message"] and "lower max_tokens" in err["message"]
    err = check_error(http.post(C, json={"prompt": "x", "model": "gpt-4"}), 404, "model")
    assert "gpt-4" in err["message"] and "tiny" in err["message"]


def test_wrong_method_and_route(http):
    assert http.get(C).status_code == 405 and http.get(C).json()["error"]["code"] == 405
    assert http.get("/v1/nope").status_code == 404 and http.get("/v1/nope").json()["error"]["code"] == 404


def test_server_is_healthy_and_correct_after_bad_inputs(http, tiny_server):
    for path, body, _, _ in CASES[:10]:
        http.post(path, content=body if isinstance(body, bytes) else json.dumps(body).encode(),
                  headers={"content-type": "application/json"})
    assert http.get("/health").status_code == 200
    r = http.post(C, json={"prompt": "fine", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    m = scrape(tiny_server.url)
    assert m['rlt:requests_rejected_total{model_name="tiny",reason="bad_request"}'] >= 10
    info = http.get("/v1/engine").json()["stats"]
    assert info["num_faults"] == 0
