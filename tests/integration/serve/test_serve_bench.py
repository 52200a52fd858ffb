"""The serving benchmark client against the tiny server: Poisson arrivals and fixed concurrency,
completions and chat; the summary carries every metric vLLM's bench serve reports. No timing
asserts — only counts, shapes and orderings that hold for any timing."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

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
