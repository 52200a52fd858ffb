"""Server lifecycle over real HTTP: client disconnects free their requests and KV, a full queue
answers 503 with Retry-After, an engine fault aborts only the requests it touched, and SIGTERM /
SIGINT shut down gracefully."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import scrape, wait_for
from test_serve_errors import check_error

C = "/v1/completions"
LONG = {"prompt": "A long answer", "max_tokens": 240, "ignore_eos": True}
POISON_TOP_K = 317  # the harness's fault trigger


def _stats(url):
    return httpx.get(f"{url}/v1/engine", timeout=10).json()["stats"]


def _idle(url):
    s = _stats(url)
    return s["in_flight"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_usage"] == 0.0


def _count(url, key):
    return scrape(url).get(key, 0.0)


ABORTS = 'rlt:requests_total{model_name="tiny",outcome="abort"}'
DISCONNECTS = 'rlt:client_disconnects_total{model_name="tiny"}'


def test_disconnect_mid_stream_aborts_and_frees_kv(tiny_server):
    url = tiny_server.url
    assert wait_for(lambda: _idle(url))
    aborts, disconnects = _count(url, ABORTS), _count(url, DISCONNECTS)
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{url}{C}", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[len("data: "):])["choices"][0]["finish_reason"] is None
            assert _stats(url)["kv_usage"] > 0  # it holds KV while it runs
    # the client is gone mid-stream: its request is aborted and its KV freed
    assert wait_for(lambda: _idle(url)), _stats(url)
    assert wait_for(lambda: _count(url, ABORTS) == aborts + 1)
    assert _count(url, DISCONNECTS) == disconnects + 1
    r = httpx.post(f"{url}{C}", json={"prompt": "after", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and httpx.get(f"{url}/health").status_code == 200


def test_disconnect_while_waiting_for_a_full_response(tiny_server):
    url = tiny_server.url
    assert wait_for(lambda: _idle(url))
    aborts = _count(url, ABORTS)
    body = json.dumps(LONG).encode()
    sock = socket.create_connection(("127.0.0.1", tiny_server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert wait_for(lambda: _stats(url)["in_flight"] == 1)
    sock.close()
    assert wait_for(lambda: _idle(url)), _stats(url)
    assert wait_for(lambda: _count(url, ABORTS) == aborts + 1)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_disconnect_before_the_body_is_a_disconnect_not_an_error(tiny_server, route):
    """A client that closes after part of its body: counted as a disconnect, no error traceback in the log."""
    url = tiny_server.url
    disconnects = _count(url, DISCONNECTS)
    sock = socket.create_connection(("127.0.0.1", tiny_server.port))
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"prompt\":" % route.encode())
    sock.close()
    assert wait_for(lambda: _count(url, DISCONNECTS) == disconnects + 1)
    assert "ClientDisconnect" not in tiny_server.stderr and "Exception in ASGI application" not in tiny_server.stderr
    r = httpx.post(f"{url}{C}", json={"prompt": "after", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200


@pytest.fixture(scope="module")
def gated(launch_server, tiny_model):
    """A server with one sequence slot and room for one more queued request, whose engine steps
    can be held (the harness's gate)."""
    return launch_server("--model", str(tiny_model), "--served-model-name", "tiny", "--dtype", "float32",
                         "--max-num-seqs", "1", "--max-queue-len", "1", "--retry-after", "3",
                         "--num-kv-blocks", "512", "--log-level", "warning", harness=True)


def _gate(url, action):
    assert httpx.post(f"{url}/_test/gate/{action}", timeout=10).status_code == 200


def test_full_queue_is_503_with_retry_after(gated):
    url = gated.url
    overloaded = 'rlt:requests_rejected_total{model_name="tiny",reason="overloaded"}'
    before = _count(url, overloaded)
    _gate(url, "close")
    try:
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(httpx.post, f"{url}{C}", json={"prompt": f"p{i}", "max_tokens": 3}, timeout=120)
                    for i in range(2)]
            assert wait_for(lambda: _stats(url)["in_flight"] == 2)  # one running (held), one queued
            for body in ({"prompt": "x", "max_tokens": 3}, {"prompt": "x", "max_tokens": 3, "stream": True}):
                r = httpx.post(f"{url}{C}", json=body, timeout=30)
                err = check_error(r, 503)
                assert r.headers["retry-after"] == "3" and "capacity" in err["message"]
            r = httpx.post(f"{url}{C}", json={"prompt": "x", "n": 2}, timeout=30)  # n counts n
            check_error(r, 503)
            _gate(url, "open")
            results = [f.result() for f in held]
    finally:
        _gate(url, "open")
    assert [r.status_code for r in results] == [200, 200]
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in results)
    assert _count(url, overloaded) == before + 3
    assert wait_for(lambda: _idle(url))
    assert httpx.post(f"{url}{C}", json={"prompt": "x", "max_tokens": 2}, timeout=30).status_code == 200


def test_engine_fault_aborts_only_its_requests(gated):
    url = gated.url
    faults = 'rlt:engine_faults_total{model_name="tiny"}'
    errors = 'rlt:requests_total{model_name="tiny",outcome="error"}'
    before_faults, before_errors = _count(url, faults), _count(url, errors)
    _gate(url, "close")
    try:
        with ThreadPoolExecutor(2) as pool:
            bad = pool.submit(httpx.post, f"{url}{C}", json={"prompt": "bad", "max_tokens": 3, "top_k": POISON_TOP_K},
                              timeout=120)
            good = pool.submit(httpx.post, f"{url}{C}", json={"prompt": "good", "max_tokens": 3}, timeout=120)
            assert wait_for(lambda: _stats(url)["in_flight"] == 2)
            _gate(url, "open")
            bad_r, good_r = bad.result(), good.result()
    finally:
        _gate(url, "open")
    assert bad_r.status_code == 500
    err = bad_r.json()["error"]
    assert err["type"] == "InternalServerError" and "injected fault" not in err["message"]
    error_id = re.search(r"error id (err-[0-9a-f]+)", err["message"]).group(1)
    assert wait_for(lambda: any(error_id in line and "injected fault" in line for line in gated.stderr.splitlines()))
    assert good_r.status_code == 200 and good_r.json()["usage"]["completion_tokens"] == 3
    assert _count(url, faults) == before_faults + 1 and _count(url, errors) == before_errors + 1
    # streaming: the fault arrives in-band, then [DONE]
    with httpx.stream("POST", f"{url}{C}", json={"prompt": "bad", "max_tokens": 3, "top_k": POISON_TOP_K,
                                                  "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == 500 and events[-1] == "data: [DONE]"
    assert httpx.get(f"{url}/health").status_code == 200
    assert _stats(url)["alive"] and wait_for(lambda: _idle(url))


def _stream_in_thread(url, body, got_first: threading.Event, lines: list):
    def run():
        try:
            with httpx.stream("POST", f"{url}{C}", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        got_first.set()
        except httpx.HTTPError as exc:
            lines.append(f"error: {type(exc).__name__}")
        got_first.set()

    t = threading.Thread(target=run)
    t.start()
    return t


def test_sigterm_lets_in_flight_requests_finish_then_exits_0(launch_server, tiny_model):
    server = launch_server("--model", str(tiny_model), "--dtype", "float32", "--num-kv-blocks", "512")
    got_first, lines = threading.Event(), []
    t = _stream_in_thread(server.url, {**LONG, "max_tokens": 60, "stream": True}, got_first, lines)
    assert got_first.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    t.join(60)
    assert lines[-1] == "data: [DONE]"  # the in-flight stream completed within the grace period
    assert json.loads(lines[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    assert "Traceback" not in server.stderr and "Application shutdown complete" in server.stderr


def test_sigint_with_no_grace_aborts_in_flight_requests_cleanly(launch_server, tiny_model):
    server = launch_server("--model", str(tiny_model), "--dtype", "float32", "--num-kv-blocks", "512",
                           "--shutdown-timeout", "0")
    got_first, lines = threading.Event(), []
    t = _stream_in_thread(server.url, {**LONG, "stream": True}, got_first, lines)
    assert got_first.wait(60)
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(60) == 130
    t.join(60)
    # no grace: the in-flight stream is aborted, and still ends properly
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["choices"][0]["finish_reason"] == "abort"
    assert "Traceback" not in server.stderr and "Application shutdown complete" in server.stderr
