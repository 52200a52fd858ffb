"""The FastAPI app in-process (Starlette's TestClient runs its lifespan, so the engine thread is
real): error shapes for what is hard to provoke over a socket (chunked oversized bodies, a defect
in a route, engine faults), and the operational endpoints."""

from __future__ import annotations

import json
import logging
import re

import pytest
from fastapi import APIRouter
from starlette.testclient import TestClient

from rlt.platform import EngineConfig
from rlt.platform.features import FeatureStatus
from rlt.serve.app import create_app
from rlt.serve.feature import HttpOptions
from rlt.serve.routes import router
from rlt.serve.server import build_state

from serve_helpers import POISON_TOP_K, poisoned_engine  # noqa: F401 - POISON_TOP_K: used by the tests

boom = APIRouter()


@boom.get("/boom")
async def _boom():
    raise KeyError("a defect")


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    engine = poisoned_engine(EngineConfig(model=str(tiny_checkpoint(seed=3, thinking=True)), dtype="float32",
                                          num_kv_blocks=256, max_num_seqs=4))
    status = FeatureStatus("http", "rlt-serve", True, True, True, "enabled")
    state = build_state(engine, statuses=[status], options=HttpOptions(max_body_bytes=4096),
                        served_names=["tiny", "alias"])
    with TestClient(create_app(state, [router, boom]), raise_server_exceptions=False) as c:
        yield c


def _is_error(r, status, param=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


def test_oversized_bodies_get_413_with_or_without_content_length(client):
    big = json.dumps({"prompt": "x" * 5000}).encode()
    r = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    _is_error(r, 413)
    assert r.content.startswith(b'{"error":{"message":')  # rendered as every other error (compact, ASCII)

    def chunks():
        for _ in range(10):
            yield b" " * 1000

    e = _is_error(client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)
    assert e["type"] == "PayloadTooLargeError" and "--max-body-bytes" in e["message"]
    text = client.get("/metrics").text
    assert 'rlt:requests_rejected_total{model_name="tiny",reason="too_large"} 2.0' in text


def _error_id(message: str) -> str:
    m = re.search(r"error id (err-[0-9a-f]+)", message)
    assert m, message
    return m.group(1)


def _logged(caplog, error_id: str) -> str:
    lines = [r.getMessage() + (r.exc_text or "") for r in caplog.records if error_id in r.getMessage()]
    assert lines, f"{error_id} is not in the log"
    return "\n".join(lines)


def test_a_defect_is_a_500_with_an_error_id_not_its_text(client, caplog):
    caplog.set_level(logging.ERROR, logger="rlt.serve")
    e = _is_error(client.get("/boom"), 500)
    assert e["type"] == "InternalServerError" and "KeyError" not in e["message"] and "defect" not in e["message"]
    record = next(r for r in caplog.records if _error_id(e["message"]) in r.getMessage())
    assert record.exc_info and record.exc_info[0] is KeyError  # the log has the traceback, under the id


def test_engine_fault_is_500_and_in_band_when_streaming(client, caplog):
    caplog.set_level(logging.ERROR, logger="rlt.serve")
    body = {"prompt": "hi", "max_tokens": 3, "top_k": POISON_TOP_K}
    e = _is_error(client.post("/v1/completions", json=body), 500)
    assert "injected fault" not in e["message"]
    assert "injected fault" in _logged(caplog, _error_id(e["message"]))
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    err = json.loads(events[0][len("data: "):])["error"]
    assert err["code"] == 500 and "injected fault" not in err["message"]
    assert "injected fault" in _logged(caplog, _error_id(err["message"]))
    assert events[-1] == "data: [DONE]"
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert client.get("/health").status_code == 200


def test_routes_and_methods(client):
    _is_error(client.get("/v1/nothing"), 404)
    _is_error(client.get("/v1/completions"), 405)
    assert client.post("/v1/completions", json={"prompt": "a", "model": "alias", "max_tokens": 1}).json()["model"] == "alias"
    _is_error(client.post("/v1/completions", json={"prompt": "a", "model": "gpt-4"}), 404, "model")


def test_operational_endpoints(client):
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["attention_backend"] == "torch"
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny", "alias"] and models["data"][0]["max_model_len"] == 256
    assert client.get("/version").json()["version"]
    info = client.get("/v1/engine").json()
    assert info["features"] == [{"name": "http", "package": "rlt-serve", "installed": True, "available": True,
                                 "enabled": True, "reason": "enabled"}]
    assert info["platform"]["name"] == "cpu" and info["attention"]["name"] == "torch"
    assert info["stats"]["alive"] and info["stats"]["capacity"] == 4 + 256
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    for name in ("rlt:time_to_first_token_seconds", "rlt:time_per_output_token_seconds",
                 "rlt:inter_token_latency_seconds", "rlt:e2e_request_latency_seconds", "rlt:kv_cache_usage_perc",
                 "rlt:num_requests_running", "rlt:num_requests_waiting", "rlt:prompt_tokens_total",
                 "rlt:generation_tokens_total", "rlt:mean_exit_depth", "rlt:requests_total"):
        assert name in metrics.text


def test_tokenize_detokenize_and_the_chat_template(client):
    t = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) and "".join(t["token_strs"]) == "Hello world"
    assert client.post("/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": "Hello world"}
    msgs = [{"role": "user", "content": "hi"}]
    plain = client.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    thinking = client.post("/tokenize", json={"messages": msgs,
                                              "chat_template_kwargs": {"enable_thinking": True}}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": thinking}).json()["prompt"].endswith("<|im_start|>assistant\n<think>\n")
    assert thinking[:len(plain)] == plain and len(thinking) > len(plain)
    _is_error(client.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")
    _is_error(client.post("/tokenize", json={}), 400)


def test_chat_names_an_invalid_max_tokens_even_beside_max_completion_tokens(client):
    msgs = [{"role": "user", "content": "hi"}]
    for extra in ({}, {"max_completion_tokens": 2}):
        e = _is_error(client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": -5, **extra}), 400,
                      "max_tokens")
        assert e["message"].startswith("max_tokens: must be an integer in [1, ") and "got -5" in e["message"]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 50, "max_completion_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
