"""Robustness of the HTTP front end in-process (Starlette's TestClient runs the lifespan, so the
engine thread is real): requests the engine ends before their prompt was processed still get a
proper answer, whatever they asked for."""

from __future__ import annotations

import json
import threading
import time

import pytest
from starlette.testclient import TestClient

from rlt.platform import EngineConfig, LLMEngine
from rlt.platform.features import FeatureStatus
from rlt.serve.app import create_app
from rlt.serve.feature import HttpOptions
from rlt.serve.routes import router
from rlt.serve.server import build_state


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    # one running request at a time: everything else waits, its prompt not yet processed
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint(seed=3, thinking=True)), dtype="float32",
                                    num_kv_blocks=256, max_num_seqs=1))
    status = FeatureStatus("http", "rlt-serve", True, True, True, "enabled")
    state = build_state(engine, statuses=[status], options=HttpOptions(), served_names=["tiny"])
    with TestClient(create_app(state, [router]), raise_server_exceptions=False) as c:
        yield state, c


def _wait_in_flight(state, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while state.engine.in_flight < n:
        assert time.monotonic() < deadline, f"only {state.engine.in_flight} of {n} requests in flight"
        time.sleep(0.01)


def _post(client, path: str, body: dict):
    if body.get("stream"):
        with client.stream("POST", path, json=body) as r:
            return r.status_code, [json.loads(line[6:]) if line != "data: [DONE]" else line
                                   for line in r.iter_lines() if line]
    r = client.post(path, json=body)
    return r.status_code, r.json()


def test_requests_aborted_before_their_prompt_ran_end_cleanly(served):
    """At shutdown (``abort_all``) a request still waiting has no prompt logprobs yet: one that
    asked for them (``echo`` + ``logprobs``, ``prompt_logprobs``) ends with ``finish_reason:
    "abort"`` like any other, not a 500 or a cut stream."""
    state, client = served
    blocker = {"prompt": "hello there", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    waiting = {
        "echo": ("/v1/completions", {**blocker, "echo": True, "logprobs": 1}),
        "echo_stream": ("/v1/completions", {**blocker, "echo": True, "logprobs": 1, "stream": True}),
        "prompt_logprobs": ("/v1/completions", {**blocker, "prompt_logprobs": 1}),
        "chat_prompt_logprobs": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 8, "prompt_logprobs": 1}),
    }
    results: dict[str, tuple] = {}

    def run(name, path, body):
        results[name] = _post(client, path, body)

    threads = [threading.Thread(target=run, args=("blocker", "/v1/completions", blocker))]
    threads[0].start()
    _wait_in_flight(state, 1)
    for name, (path, body) in waiting.items():
        threads.append(threading.Thread(target=run, args=(name, path, body)))
        threads[-1].start()
    _wait_in_flight(state, 1 + len(waiting))
    client.portal.call(state.engine.abort_all)
    for t in threads:
        t.join(60)
    assert set(results) == {"blocker", *waiting}

    for name in ("blocker", "echo", "prompt_logprobs", "chat_prompt_logprobs"):
        status, body = results[name]
        assert status == 200, (name, body)
        assert body["choices"][0]["finish_reason"] == "abort", (name, body)
    echo = results["echo"][1]["choices"][0]
    assert echo["text"].startswith("hello there")
    lp = echo["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == results["echo"][1]["usage"]["prompt_tokens"]
    assert all(v is None for v in lp["token_logprobs"])  # the prompt's logprobs were never computed
    assert results["prompt_logprobs"][1]["choices"][0]["prompt_logprobs"] is None
    assert results["chat_prompt_logprobs"][1]["prompt_logprobs"] is None

    status, events = results["echo_stream"]
    assert status == 200 and events[-1] == "data: [DONE]", events
    assert all("error" not in e for e in events[:-1]), events
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]).startswith("hello there")

    assert state.engine.in_flight == 0
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "echo": True, "logprobs": 1})
    assert ok.status_code == 200 and ok.json()["choices"][0]["logprobs"]["token_logprobs"][1] is not None


@pytest.mark.parametrize("field", ["shutdown_timeout", "body_read_timeout", "watchdog_timeout"])
def test_http_options_refuse_nan(field):
    """``--watchdog-timeout nan`` (argparse reads it as a float) used to be accepted and turn the
    watchdog (or the body read timeout) silently off; it is refused, naming the flag."""
    from rlt.serve.feature import HttpOptions

    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=f"^{flag} must be >= 0"):
        HttpOptions(**{field: float("nan")})
    HttpOptions(**{field: 0.0})
