"""Issue 15 over real HTTP (a server in a subprocess): requests that used to wedge the server,
500 on bad text, stall it with a huge prompt, or get a retryable 503 they could never get past;
the API key, the read timeout for bodies, no paths and no exception text in responses, the docs
switch, the watchdog, and ``param`` in engine-side errors.

After every bad request the server must still serve a normal request within a second, and the
engine's slot and KV counts must be back to idle.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import wait_for
from test_serve_errors import MSG, check_error

C, CHAT, TOK = "/v1/completions", "/v1/chat/completions", "/tokenize"
POISON_TOP_K, POISON_ADMIT_TOP_K = 317, 318
MAX_NUM_SEQS, MAX_QUEUE_LEN = 8, 8
CAPACITY = MAX_NUM_SEQS + MAX_QUEUE_LEN
#: a 7.8 MB prompt: under the default 8 MiB body limit
HUGE = "hello world " * 650_000


def post(url: str, path: str, body, timeout: float = 20.0, **kw) -> httpx.Response:
    """POST a JSON body as bytes (json.dumps escapes lone surrogates; httpx's json= cannot send them)."""
    return httpx.post(f"{url}{path}", content=json.dumps(body).encode(),
                      headers={"content-type": "application/json", **kw.pop("headers", {})}, timeout=timeout, **kw)


def stats(url: str, headers=None) -> dict:
    return httpx.get(f"{url}/v1/engine", timeout=10, headers=headers).json()["stats"]


def idle(url: str, headers=None) -> bool:
    st = stats(url, headers)
    return (st["num_running"] == 0 and st["num_waiting"] == 0 and st["in_flight"] == 0
            and st["num_free_kv_blocks"] == st["num_kv_blocks"])


def assert_recovers(url: str, headers=None) -> None:
    """The server serves a normal request within a second, and the engine is back to idle."""
    t0 = time.monotonic()
    r = httpx.post(f"{url}{C}", json={"prompt": "fine", "max_tokens": 2, "temperature": 0}, timeout=10,
                   headers=headers)
    took = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    assert took < 1.0, f"a normal request took {took:.2f} s"
    assert wait_for(lambda: idle(url, headers), timeout=10), stats(url, headers)
    assert httpx.get(f"{url}/health", timeout=10, headers=headers).status_code == 200


def check_stream_error(url: str, path: str, body: dict, status: int, param=None) -> None:
    """The same request streaming fails the same way, before any stream starts."""
    check_error(post(url, path, {**body, "stream": True}), status, param)


@pytest.fixture(scope="module")
def unbounded_model(tiny_model, tmp_path_factory):
    """The tiny checkpoint with an NFC normalizer: its tokenizer gives no characters-per-token bound
    (a normalizer may shorten text), so long prompts take the prefix-probing path."""
    path = tmp_path_factory.mktemp("unbounded") / "tiny-nfc"
    shutil.copytree(tiny_model, path)
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "NFC"}
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


def _hard_flags(model) -> list[str]:
    return ["--model", str(model), "--served-model-name", "tiny", "--dtype", "float32", "--num-kv-blocks", "512",
            "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queue-len", str(MAX_QUEUE_LEN), "--watchdog-timeout", "2",
            "--body-read-timeout", "3", "--log-level", "warning"]


@pytest.fixture(scope="module")
def hard(launch_server, unbounded_model):
    """Small capacity, a 2 s watchdog, a 3 s body read timeout, the default 8 MiB body limit, and
    the test harness (step gate, fault injection)."""
    return launch_server(*_hard_flags(unbounded_model), harness=True)


# -- 1. values past the engine's storage ranges ----------------------------------------------------
OVERFLOW = [
    (C, {"prompt": "x", "top_k": 2**63}, "top_k"),
    (C, {"prompt": "x", "top_k": 2**63, "n": 4}, "top_k"),
    (CHAT, {"messages": MSG, "min_tokens": 2**63}, "min_tokens"),  # no max_tokens: min_tokens alone
    (C, {"prompt": "x", "max_tokens": None, "min_tokens": 2**63}, "min_tokens"),
    (C, {"prompt": "x", "max_tokens": 2**63}, "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 2**64}, "max_completion_tokens"),
    (C, {"prompt": "x", "seed": 2**64}, "seed"),
    (C, {"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    (C, {"prompt": "x", "priority": 2**63}, "priority"),
    (C, {"prompt": "x", "min_loops": 2**31}, "min_loops"),
    (C, {"prompt": "x", "max_loops": 2**31}, "max_loops"),
    (C, {"prompt": "x", "stop_token_ids": [2**63]}, "stop_token_ids"),
    (C, {"prompt": "x", "temperature": 1e39}, "temperature"),
    (CHAT, {"messages": MSG, "top_k": 2**100, "n": 64}, "top_k"),
]


@pytest.mark.parametrize("path, body, param", OVERFLOW, ids=[f"{i}-{c[2]}" for i, c in enumerate(OVERFLOW)])
def test_values_past_the_engines_storage_are_400(hard, path, body, param):
    check_error(post(hard.url, path, body, timeout=10), 400, param)
    check_stream_error(hard.url, path, body, 400, param)
    assert_recovers(hard.url)


def test_four_wedging_requests_no_longer_take_every_slot(hard):
    """The issue's recipe: four top_k >= 2**63 requests with n=64 used to take all 256 slots."""
    for _ in range(4):
        check_error(post(hard.url, C, {"prompt": "x", "top_k": 2**63, "n": 64, "stream": True}, timeout=10), 400,
                    "top_k")
    assert_recovers(hard.url)


def test_a_failure_after_a_slot_is_taken_gives_it_back(launch_server, unbounded_model):
    """Admission fails after the scheduler took a slot and KV (the harness makes writing the slot
    table raise): both come back and the client gets an error, streaming or not."""
    server = launch_server(*_hard_flags(unbounded_model), harness=True)
    for stream in (False, True):
        r = post(server.url, C, {"prompt": "x", "max_tokens": 2, "top_k": POISON_ADMIT_TOP_K, "n": 4,
                                 "stream": stream}, timeout=10)
        if r.status_code == 200:  # a stream had begun: the error arrives in-band, then [DONE]
            events = [line for line in r.text.splitlines() if line]
            assert any('"error"' in e for e in events) and events[-1] == "data: [DONE]"
        else:
            assert r.status_code in (400, 500) and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert_recovers(server.url)


# -- 2. text that is not valid Unicode -------------------------------------------------------------
SURROGATES = [
    (C, {"prompt": "a\ud800b"}, "prompt"),
    (C, {"prompt": ["fine", "a\udfffb"]}, "prompt.1"),
    (C, {"prompt": "x", "stop": ["\ud800"]}, "stop.0"),
    (CHAT, {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages.0.content.0.text"),
    (CHAT, {"messages": [{"role": "us\ud800er", "content": "x"}]}, "messages.0.role"),
    (CHAT, {"messages": MSG, "chat_template_kwargs": {"enable_thinking": "\ud800"}},
     "chat_template_kwargs.enable_thinking"),
    (TOK, {"prompt": "a\ud800b"}, "prompt"),
    (TOK, {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
    (C, {"prompt": "x", "model": "a\ud800"}, "model"),
]


@pytest.mark.parametrize("path, body, param", SURROGATES, ids=[f"{i}-{c[2]}" for i, c in enumerate(SURROGATES)])
def test_a_lone_surrogate_is_a_400_naming_the_field(hard, path, body, param):
    err = check_error(post(hard.url, path, body), 400, param)
    assert "lone surrogate" in err["message"]
    if path != TOK:
        check_stream_error(hard.url, path, body, 400, param)
    assert_recovers(hard.url)


# -- 3. a prompt far over the context ------------------------------------------------------------
@pytest.mark.parametrize("path, body, param", [
    (C, {"prompt": HUGE}, "prompt"),
    (C, {"prompt": ["fine", HUGE[:3_000_000]]}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": HUGE}]}, "messages"),
    (TOK, {"prompt": HUGE}, "prompt"),
])
def test_a_huge_prompt_is_refused_without_tokenising_it_all(hard, path, body, param):
    t0 = time.monotonic()
    err = check_error(post(hard.url, path, body, timeout=60), 400, param)
    took = time.monotonic() - t0
    assert "maximum context length of 256 tokens" in err["message"]
    assert took < 3.0, f"{took:.1f} s to refuse a prompt that cannot fit (was 20.9 s)"
    assert_recovers(hard.url)


def test_huge_prompts_in_flight_do_not_stall_anyone(hard):
    body = json.dumps({"prompt": HUGE}).encode()
    headers = {"content-type": "application/json"}
    with ThreadPoolExecutor(8) as pool:
        bigs = [pool.submit(httpx.post, f"{hard.url}{C}", content=body, headers=headers, timeout=120)
                for _ in range(8)]
        time.sleep(0.2)
        t0 = time.monotonic()
        health = httpx.get(f"{hard.url}/health", timeout=60)
        t_health = time.monotonic() - t0
        t0 = time.monotonic()
        small = httpx.post(f"{hard.url}{C}", json={"prompt": "hi", "max_tokens": 2}, timeout=120)
        t_small = time.monotonic() - t0
        results = [f.result() for f in bigs]
    assert health.status_code == 200 and t_health < 2.0, f"/health took {t_health:.1f} s (was 9 s)"
    assert small.status_code == 200 and t_small < 5.0, f"a small completion took {t_small:.1f} s (was 84 s)"
    for r in results:
        check_error(r, 400, "prompt")
    assert_recovers(hard.url)


# -- 4. requests that can never fit ----------------------------------------------------------------
NEVER_FITS = [
    (C, {"prompt": ["x"] * (CAPACITY + 1), "max_tokens": 1}, "prompt"),
    (C, {"prompt": [[5]] * (CAPACITY + 1), "max_tokens": 1}, "prompt"),
    (C, {"prompt": ["x", "y"], "n": CAPACITY // 2 + 1, "max_tokens": 1}, "prompt"),
    (C, {"prompt": "x", "n": CAPACITY + 1, "max_tokens": 1}, "n"),
    (CHAT, {"messages": MSG, "n": CAPACITY + 1, "max_tokens": 1}, "n"),
]


@pytest.mark.parametrize("path, body, param", NEVER_FITS, ids=[f"{i}-{c[2]}" for i, c in enumerate(NEVER_FITS)])
def test_a_request_that_can_never_fit_is_400_not_503(hard, path, body, param):
    assert idle(hard.url)
    r = post(hard.url, path, body)
    err = check_error(r, 400, param)
    assert "Retry-After" not in r.headers
    assert "can never be admitted" in err["message"] and str(CAPACITY) in err["message"]
    check_stream_error(hard.url, path, body, 400, param)
    assert_recovers(hard.url)


def test_openai_client_does_not_retry_a_request_that_can_never_fit(hard):
    sent = []
    http = httpx.Client(event_hooks={"request": [lambda request: sent.append(request.url.path)]})
    client = openai.OpenAI(base_url=f"{hard.url}/v1", api_key="unused", max_retries=3, timeout=30, http_client=http)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=["x"] * (CAPACITY + 1), max_tokens=1)
    assert e.value.status_code == 400 and e.value.param == "prompt" and sent == ["/v1/completions"]
    sent.clear()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSG, n=CAPACITY + 1, max_tokens=1)
    assert e.value.param == "n" and sent == ["/v1/chat/completions"]
    # and the other cases of this issue, with their exception classes
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body={"top_k": 2**63})
    assert e.value.param == "top_k"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert client.completions.create(model="tiny", prompt="x", max_tokens=1).usage.completion_tokens == 1


# -- 5. what a response may not reveal; read timeout; docs ----------------------------------------
def test_no_filesystem_paths_in_responses(hard, unbounded_model):
    base = str(unbounded_model.parent.parent)  # pytest's temporary root, which every test path is under
    for route in ("/v1/models", "/v1/engine", "/health", "/version"):
        text = httpx.get(f"{hard.url}{route}", timeout=10).text
        assert str(unbounded_model) not in text and base not in text, (route, text[:300])
    card = httpx.get(f"{hard.url}/v1/models", timeout=10).json()["data"][0]
    assert card["id"] == "tiny" and card["root"] == unbounded_model.name
    assert httpx.get(f"{hard.url}/v1/engine", timeout=10).json()["model"]["name"] == unbounded_model.name
    assert f"model:     {unbounded_model} served as tiny" in hard.stdout  # the startup log has the path


def test_a_500_says_only_an_error_id_which_the_log_has(hard):
    for stream in (False, True):
        r = post(hard.url, C, {"prompt": "x", "max_tokens": 2, "top_k": POISON_TOP_K, "stream": stream})
        if stream:
            assert r.status_code == 200
            err = json.loads([e for e in r.text.splitlines() if '"error"' in e][0][len("data: "):])["error"]
        else:
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["type"] == "InternalServerError" and err["code"] == 500
        assert "injected" not in err["message"] and "RuntimeError" not in err["message"]
        error_id = re.search(r"error id (err-[0-9a-f]+)", err["message"]).group(1)
        assert wait_for(lambda: any(error_id in line and "injected fault" in line
                                    for line in hard.stderr.splitlines())), hard.stderr[-2000:]
    assert_recovers(hard.url)


def _raw(url: str, data: bytes, trickle: bytes = b"", every: float = 0.45, wait: float = 10.0) -> tuple[bytes, float]:
    """Send ``data``, then ``trickle`` a byte at a time; return (what came back, seconds until it came).

    A trickling client may send a byte just as the server answers and closes; the server's kernel then
    resets the connection instead of closing it (unread data), after the answer has arrived. That reset
    ends the stream like a close does. ``every`` is chosen so that no byte is due at a whole second, where
    the server's deadlines fall.
    """
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        t0 = time.monotonic()
        sock.sendall(data)
        sock.settimeout(every if trickle else wait)
        got = b""
        for b in trickle:
            try:
                got += sock.recv(65536)
                break
            except socket.timeout:
                try:
                    sock.sendall(bytes([b]))
                except (BrokenPipeError, ConnectionResetError):
                    break  # the server closed; what it answered is read below
        sock.settimeout(wait)
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                got += chunk
        except socket.timeout:
            pass
        except ConnectionResetError:
            if not got:
                raise
        return got, time.monotonic() - t0


@pytest.mark.parametrize("trickle", [b"", b'"' * 400], ids=["stalled", "trickled"])
def test_a_body_that_never_finishes_arriving_gets_408(hard, trickle):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
    got, took = _raw(hard.url, head, trickle)
    status_line, _, rest = got.partition(b"\r\n")
    assert b" 408 " in status_line, got[:300]
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == 408 and "--body-read-timeout" in body["error"]["message"]
    assert 2.5 < took < 8.0  # the 3 s limit, and the connection was closed (recv saw the end)
    assert_recovers(hard.url)


def test_api_docs_are_off_by_default(hard):
    for route in ("/docs", "/redoc", "/openapi.json"):
        check_error(httpx.get(f"{hard.url}{route}", timeout=10), 404)


KEY = "s3cret-key"


@pytest.fixture(scope="module")
def keyed(launch_server, tiny_model):
    return launch_server("--model", str(tiny_model), "--served-model-name", "tiny", "--dtype", "float32",
                         "--num-kv-blocks", "256", "--max-num-seqs", "4", "--api-key", KEY, "--api-docs",
                         "--log-level", "warning")


@pytest.fixture(scope="module")
def env_keyed(launch_server, tiny_model):
    old = os.environ.get("RLT_API_KEY")
    os.environ["RLT_API_KEY"] = "from-the-env"
    try:
        return launch_server("--model", str(tiny_model), "--dtype", "float32", "--num-kv-blocks", "256",
                             "--max-num-seqs", "4", "--no-public-health-metrics", "--log-level", "warning",
                             wait=False)
    finally:
        if old is None:
            os.environ.pop("RLT_API_KEY")
        else:
            os.environ["RLT_API_KEY"] = old


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _check_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(r.json()) == {"error"} and err["type"] == "AuthenticationError" and err["code"] == 401


def test_api_key_is_required(keyed):
    url = keyed.url
    for headers in ({}, _auth("wrong"), {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        _check_401(httpx.post(f"{url}{C}", json={"prompt": "x", "max_tokens": 1}, headers=headers, timeout=10))
        _check_401(httpx.get(f"{url}/v1/models", headers=headers, timeout=10))
        _check_401(httpx.get(f"{url}/docs", headers=headers, timeout=10))
    # a huge body without the key is refused before it is read
    _check_401(httpx.post(f"{url}{C}", content=b"x" * 2_000_000, headers={"content-type": "application/json"},
                          timeout=30))
    assert httpx.get(f"{url}/v1/models", headers=_auth(KEY), timeout=10).status_code == 200
    assert httpx.get(f"{url}/v1/models", headers={"authorization": f"bearer {KEY}"}, timeout=10).status_code == 200
    # /health and /metrics stay open by default; /docs is on (--api-docs), behind the key
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
    assert httpx.get(f"{url}/docs", headers=_auth(KEY), timeout=10).status_code == 200
    assert httpx.get(f"{url}/openapi.json", headers=_auth(KEY), timeout=10).json()["info"]["title"] == "rlt"
    assert 'reason="unauthorized"} 1' in httpx.get(f"{url}/metrics", timeout=10).text
    # the key is never shown
    assert KEY not in keyed.stdout and KEY not in httpx.get(f"{url}/v1/engine", headers=_auth(KEY)).text
    assert_recovers(url, headers=_auth(KEY))


def test_openai_client_with_and_without_the_key(keyed):
    bad = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="x", max_tokens=1)
    good = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0, timeout=30)
    assert good.completions.create(model="tiny", prompt="x", max_tokens=1).usage.completion_tokens == 1
    with pytest.raises(openai.NotFoundError):
        good.completions.create(model="nope", prompt="x", max_tokens=1)


def test_api_key_from_the_environment_and_closed_health(env_keyed):
    url = env_keyed.url  # started without waiting: its /health needs the key
    assert wait_for(lambda: _status(f"{url}/health", _auth("from-the-env")) == 200, timeout=120), env_keyed.stderr
    _check_401(httpx.get(f"{url}/health", timeout=10))
    _check_401(httpx.get(f"{url}/metrics", timeout=10))
    assert httpx.get(f"{url}/metrics", headers=_auth("from-the-env"), timeout=10).status_code == 200
    _check_401(httpx.post(f"{url}{C}", json={"prompt": "x", "max_tokens": 1}, headers=_auth(KEY), timeout=10))
    assert_recovers(url, headers=_auth("from-the-env"))


def _status(url: str, headers: dict) -> int | None:
    try:
        return httpx.get(url, headers=headers, timeout=2).status_code
    except httpx.TransportError:
        return None


# -- the watchdog --------------------------------------------------------------------------------
def _unhealthy(url: str) -> httpx.Response | None:
    h = httpx.get(f"{url}/health", timeout=10)
    return h if h.status_code == 503 else None


def test_health_fails_while_requests_wait_and_no_step_runs(hard):
    url = hard.url
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    httpx.post(f"{url}/_test/gate/close", timeout=10)
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(httpx.post, f"{url}{C}", json={"prompt": "x", "max_tokens": 2}, timeout=60)
            r = wait_for(lambda: _unhealthy(url), timeout=15)
            assert r is not None, "the watchdog never tripped"
            assert r.json()["status"] == "unhealthy" and "no engine step" in r.json()["reason"]
            assert "--watchdog-timeout 2" in r.json()["reason"] and stats(url)["stall_reason"]
            httpx.post(f"{url}/_test/gate/open", timeout=10)
            assert held.result().status_code == 200
    finally:
        httpx.post(f"{url}/_test/gate/open", timeout=10)
    assert wait_for(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200, timeout=10)
    assert "engine stalled" in hard.stderr
    assert_recovers(url)


# -- 6. engine-side errors name their field -------------------------------------------------------
SERVE_SIDE_PARAMS = [  # checked by rlt-serve before the engine sees the request
    (C, {"prompt": "word " * 300}, "prompt"),
    (C, {"prompt": [5] * 300}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 300}]}, "messages"),
]
ENGINE_SIDE_PARAMS = [  # the engine's own checks: InvalidRequestError(param=...)
    (C, {"prompt": "x", "max_tokens": 400}, ("max_tokens", "prompt")),
    (CHAT, {"messages": MSG, "max_completion_tokens": 400}, ("max_completion_tokens", "messages")),
    (C, {"prompt": "x", "max_loops": 9}, ("max_loops",)),
    (CHAT, {"messages": MSG, "max_loops": 9}, ("max_loops",)),
    (C, {"prompt": ""}, ("prompt",)),
]


@pytest.mark.parametrize("path, body, param", SERVE_SIDE_PARAMS, ids=[f"{i}-{c[2]}" for i, c in
                                                                    enumerate(SERVE_SIDE_PARAMS)])
def test_context_errors_name_their_field(hard, path, body, param):
    err = check_error(post(hard.url, path, body), 400, param)
    assert "maximum context length is 256" in err["message"]
    assert_recovers(hard.url)


@pytest.mark.parametrize("path, body, params", ENGINE_SIDE_PARAMS, ids=[f"{i}-{c[2][0]}" for i, c in
                                                                      enumerate(ENGINE_SIDE_PARAMS)])
def test_engine_errors_name_their_field(hard, path, body, params):
    err = check_error(post(hard.url, path, body), 400)
    assert err["param"] in params, err
    assert_recovers(hard.url)


def test_concurrent_bad_requests_leave_the_engine_idle(hard):
    bodies = [b for _, b, _ in OVERFLOW if "messages" not in b] + [b for p, b, _ in SURROGATES if p == C]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda b: post(hard.url, C, b), bodies * 3))
    assert all(r.status_code == 400 for r in results)
    assert_recovers(hard.url)
