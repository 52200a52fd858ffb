"""The serving benchmark client against the tiny server: Poisson arrivals and fixed concurrency,
completions and chat; the summary carries every metric vLLM's bench serve reports. No timing
asserts — only counts, shapes and orderings that hold for any timing."""

from __future__ import annotations

import asyncio
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
serve_bench = pytest.importorskip("benchmarks.serve_bench")


def test_percentile_matches_linear_interpolation():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert serve_bench.percentile(xs, 0) == 1.0 and serve_bench.percentile(xs, 100) == 4.0
    assert serve_bench.percentile(xs, 50) == 2.5 and math.isclose(serve_bench.percentile(xs, 95), 3.85)


def test_arrivals_are_rescaled_to_end_at_n_over_rate():
    times = serve_bench.arrival_times(50, 10.0, 1.0, random.Random(0))
    assert times == sorted(times) and math.isclose(times[-1], 5.0)
    assert serve_bench.arrival_times(3, float("inf"), 1.0, random.Random(0)) == [0.0, 0.0, 0.0]


def _bench(tmp_path, url, *flags):
    out = tmp_path / "result.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_bench.py"), "--base-url", url,
                        "--result-file", str(out), *flags], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Serving Benchmark Result" in r.stdout and "P99 TTFT (ms)" in r.stdout
    return json.loads(out.read_text())


def _check_stats(s, n, out_len):
    assert s["completed"] == n and s["failed"] == 0 and s["errors"] == []
    assert s["total_output_tokens"] == n * out_len and s["total_input_tokens"] > 0
    assert s["model"] == "tiny"
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        st = s[key]
        assert set(st) == {"mean", "median", "std", "p50", "p95", "p99"}
        assert 0 <= st["p50"] <= st["p95"] <= st["p99"]
    assert s["ttft_ms"]["p50"] <= s["e2el_ms"]["p99"]
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0
    assert s["total_token_throughput"] > s["output_throughput"]


def test_poisson_rate_on_completions(tiny_server, tmp_path):
    s = _bench(tmp_path, tiny_server.url, "--num-prompts", "12", "--request-rate", "40", "--input-len", "6",
               "--output-len", "4", "--ignore-eos", "--temperature", "0.8")
    _check_stats(s, 12, 4)
    assert s["request_rate"] == 40 and s["max_concurrent_requests"] >= 1


def test_fixed_concurrency_on_chat(tiny_server, tmp_path):
    s = _bench(tmp_path, tiny_server.url, "--endpoint", "/v1/chat/completions", "--num-prompts", "8",
               "--max-concurrency", "3", "--output-len", "5", "--ignore-eos", "--num-warmups", "1")
    _check_stats(s, 8, 5)
    assert 1 <= s["max_concurrent_requests"] <= 3


def test_failures_are_reported(tiny_server, tmp_path):
    out = tmp_path / "bad.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_bench.py"), "--base-url", tiny_server.url,
                        "--model", "no-such-model", "--num-prompts", "2", "--result-file", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    s = json.loads(out.read_text())
    assert s["failed"] == 2 and "HTTP 404" in s["errors"][0]


class _ScriptedStream(httpx.AsyncByteStream):
    """SSE bytes of a scripted server: before each piece, the fake clock advances by its delay."""

    def __init__(self, clock, script):
        self.clock, self.script = clock, script

    async def __aiter__(self):
        for delay, raw in self.script:
            self.clock.t += delay
            yield raw


class _Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def _event(payload) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def _one_request(clock, script, chat: bool):
    """serve_bench's one request against a server that sends ``script`` ((delay, bytes) pairs) on ``clock``."""
    transport = httpx.MockTransport(lambda req: httpx.Response(200, stream=_ScriptedStream(clock, script)))

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await serve_bench.one_request(client, "http://fake/v1/x", {}, chat, 10.0)

    return asyncio.run(go())


@pytest.mark.parametrize("chat", [False, True])
def test_metrics_follow_vllm_bench_serve_definitions(monkeypatch, chat):
    """Known chunk timings in, vLLM's TTFT / ITL / E2EL / TPOT out: every chunk with choices is timed
    (empty text included, raw U+2028 in a string included), the usage chunk is not; in chat (as
    ``vllm bench serve`` 0.33 decides) neither is the opening role chunk nor a delta without content."""
    clock = _Clock()
    monkeypatch.setattr(serve_bench, "clock", clock)

    def choice(text):
        return {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}

    first = _event({"choices": [choice("")]})  # a token that decodes to nothing
    tail = _event({"choices": [choice("b\u2028c")]})
    usage = _event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}})
    body = [(0.5, _event({"choices": [choice("a")]})), (0.125, _event({"choices": [choice("")]})),
            (0.0625, tail[:9]), (0.0, tail[9:])]  # one event split across reads
    if chat:  # rlt and vLLM: the role chunk goes out with the first token, in the same write
        role = _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        finish = _event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        script = [(0.125, role), (0.125, first), *body, (0.5, finish), (0.5, usage)]
    else:
        script = [(0.25, first), *body, (1.0, usage)]
    script.append((0.0, b"data: [DONE]\n\n"))
    res = _one_request(clock, script, chat)
    assert res.ok and res.error == ""
    assert res.ttft == 0.25 and res.itl == [0.5, 0.125, 0.0625]
    assert res.latency == 0.9375  # the last timed chunk, not the usage (or chat's finish-only) chunk
    assert res.output_tokens == 5 and res.prompt_tokens == 3 and res.empty_chunks == 2
    args = serve_bench.parse_args(["--percentiles", "50"])
    s = serve_bench.summarize(args, "m", [res], 2.0)
    assert s["tpot_ms"]["mean"] == pytest.approx((0.9375 - 0.25) / 4 * 1000)
    assert s["itl_ms"]["mean"] == pytest.approx((0.5 + 0.125 + 0.0625) / 3 * 1000)
    assert s["ttft_ms"]["p50"] == pytest.approx(250.0) and s["empty_chunks"] == 2


def test_a_chat_stream_of_only_a_role_chunk_is_a_failure(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(serve_bench, "clock", clock)
    script = [(0.1, _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})),
              (0.0, b"data: [DONE]\n\n")]
    res = _one_request(clock, script, True)
    assert not res.ok and "TTFT" in res.error


def test_a_stream_without_choices_is_a_failure(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(serve_bench, "clock", clock)
    script = [(0.1, _event({"choices": [], "usage": {"completion_tokens": 0}})), (0.0, b"data: [DONE]\n\n")]
    res = _one_request(clock, script, False)
    assert not res.ok and "TTFT" in res.error
