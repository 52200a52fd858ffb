"""Serving benchmark client for any OpenAI-compatible server (rlt, vLLM, ...), after ``vllm bench serve``.

Load: ``--num-prompts`` requests arriving as a Poisson process at ``--request-rate`` req/s
(inter-arrival gaps ~ Gamma(burstiness, 1 / (rate * burstiness)); burstiness 1 is Poisson; the
schedule is rescaled so the last arrival lands at num_prompts / rate, as vLLM does), or all at
once (``--request-rate inf``), optionally capped at ``--max-concurrency`` requests in flight.
Every request streams (SSE) with ``stream_options.include_usage``, unless ``--no-stream``: then each
request is one JSON response, TTFT = E2EL = the time to that response, and TPOT / ITL are not
measured (there are no chunks to time).

Per request, with ``vllm bench serve``'s definitions (as of vLLM 0.33): every SSE chunk that has
choices is timed, whether or not it carries text (a token may decode to nothing), except, in chat,
chunks whose delta has no output: the opening ``role`` chunk (empty ``content``) and deltas without
``content``: TTFT = send -> first such chunk; ITL = gaps between successive such chunks; E2EL = send ->
the last such chunk; output tokens = the server's ``usage.completion_tokens`` when sent, else the
number of such chunks; TPOT = (E2EL - TTFT) / (output tokens - 1), for requests with more than one
output token. How many timed chunks carried no text is reported too (``empty_chunks``). The stream
is split into lines on ``\n`` only, as SSE is framed (not on U+2028 and friends, which
``str.splitlines`` and httpx's ``aiter_lines`` also break on). Aggregates: mean, median, std and the chosen percentiles
(default 50, 95, 99) of TTFT / TPOT / ITL (pooled over all gaps) / E2EL in ms; request, output
and total token throughput over the benchmark's duration; peak concurrent requests.

Prompts are random words (``--input-len`` words each; the real token count comes back in usage)
or lines of ``--prompt-file``. Results print as a table and, with ``--result-file``, as JSON.

    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --request-rate 8 --input-len 128 --output-len 64 --ignore-eos --result-file out.json

Needs only httpx. Sends traffic only to ``--base-url``; bounded by ``--num-prompts`` and
``--timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import httpx

_WORDS = ("the of and to in is it you that he was for on are with as his they be at one have this from "
          "loop depth token batch exit gate model layer state cache page prompt stream server request "
          "quick brown fox jumps over lazy dog number value time step rate memory kernel").split()


@dataclass
class RequestResult:
    ok: bool = False
    prompt_tokens: int | None = None
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    #: timed chunks (with choices) whose text was empty
    empty_chunks: int = 0
    start: float = 0.0
    end: float = 0.0
    error: str = ""


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Send offsets (s) of ``n`` requests: all 0 for an infinite rate, else a Gamma-gap process
    rescaled so the last arrival is at ``n / rate``."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    theta = 1.0 / (rate * burstiness)
    t, times = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, theta)
        times.append(t)
    scale = (n / rate) / times[-1]
    return [x * scale for x in times]


def make_prompts(args: argparse.Namespace, rng: random.Random) -> list[str]:
    if args.prompt_file:
        lines = [ln.rstrip("\r") for ln in Path(args.prompt_file).read_text().split("\n") if ln.strip()]
        if not lines:
            raise SystemExit(f"{args.prompt_file}: no prompts")
        return [lines[i % len(lines)] for i in range(args.num_prompts)]
    return [" ".join(rng.choice(_WORDS) for _ in range(args.input_len)) for _ in range(args.num_prompts)]


def request_body(args: argparse.Namespace, model: str, prompt: str, chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": args.output_len, "temperature": args.temperature}
    if args.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    else:
        body["stream"] = False
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.top_p is not None:
        body["top_p"] = args.top_p
    if args.top_k is not None:
        body["top_k"] = args.top_k
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(args.extra_body)
    return body


#: the benchmark's clock (a test replaces it to script chunk timings)
clock = time.perf_counter


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The ``data:`` payloads of an SSE stream, lines split on ``\n`` only (``\r`` stripped)."""
    buf = ""
    async for text in response.aiter_text():
        *lines, buf = (buf + text).split("\n")
        for line in lines:
            if line.startswith("data:"):
                yield line[len("data:"):].strip()
    if buf.startswith("data:"):
        yield buf[len("data:"):].strip()


def _chat_token_chunk(choice: dict[str, Any]) -> bool:
    """Whether a chat chunk's first choice carries output, as ``vllm bench serve`` (0.33) decides what
    to time: non-empty ``content`` (or ``reasoning`` / ``tool_calls`` / ``function_call``), or an empty
    ``content`` without ``role`` (a token that decodes to nothing). The opening chunk (``role`` with
    empty ``content``) and a delta without ``content`` are not timed."""
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False
    if delta.get("content") or delta.get("reasoning") or delta.get("tool_calls") or delta.get("function_call"):
        return True
    return delta.get("content") == "" and "role" not in delta


async def one_plain_request(client: httpx.AsyncClient, url: str, body: dict, timeout: float) -> RequestResult:
    """A non-streaming request: one JSON response; TTFT = E2EL = its arrival."""
    res = RequestResult()
    res.start = clock()
    try:
        r = await client.post(url, json=body, timeout=timeout)
        if r.status_code != 200:
            res.error = f"HTTP {r.status_code}: {r.text[:300]}"
            return res
        msg = r.json()
        res.end = clock()
        res.ttft = res.latency = res.end - res.start
        usage = msg.get("usage") or {}
        res.prompt_tokens = usage.get("prompt_tokens")
        res.output_tokens = usage.get("completion_tokens") or 0
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, asyncio.TimeoutError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def one_request(client: httpx.AsyncClient, url: str, body: dict, chat: bool, timeout: float) -> RequestResult:
    if body.get("stream") is False:
        return await one_plain_request(client, url, body, timeout)
    res = RequestResult()
    res.start = clock()
    last = res.start
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for data in sse_data(r):
                if data == "[DONE]":
                    break
                now = clock()
                msg = json.loads(data)
                if "error" in msg:
                    res.error = f"in-band error: {msg['error']}"
                    return res
                if msg.get("usage"):
                    res.prompt_tokens = msg["usage"].get("prompt_tokens")
                    if msg["usage"].get("completion_tokens") is not None:
                        res.output_tokens = msg["usage"]["completion_tokens"]
                choices = msg.get("choices")
                if not choices or (chat and not _chat_token_chunk(choices[0])):
                    continue
                if chunks == 0:
                    res.ttft = now - res.start
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
                c = choices[0]
                if not ((c.get("delta") or {}).get("content") if chat else c.get("text")):
                    res.empty_chunks += 1
        if chunks == 0:
            res.error = "no chunk with choices arrived: TTFT cannot be measured"
            return res
        res.end = clock()
        res.latency = last - res.start
        if res.output_tokens == 0:
            res.output_tokens = chunks
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, asyncio.TimeoutError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    r = await client.get(f"{base_url}/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    base = args.base_url.rstrip("/")
    chat = args.endpoint.rstrip("/").endswith("chat/completions")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits) as client:
        model = args.model or await first_model(client, base)
        prompts = make_prompts(args, rng)
        url = f"{base}{args.endpoint}"
        for i in range(args.num_warmups):
            await one_request(client, url, request_body(args, model, prompts[i % len(prompts)], chat), chat,
                              args.timeout)
        offsets = arrival_times(len(prompts), args.request_rate, args.burstiness, rng)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        t0 = time.perf_counter()

        async def launch(prompt: str, offset: float) -> RequestResult:
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                return await one_request(client, url, request_body(args, model, prompt, chat), chat, args.timeout)
            async with sem:
                return await one_request(client, url, request_body(args, model, prompt, chat), chat, args.timeout)

        results = await asyncio.gather(*(launch(p, o) for p, o in zip(prompts, offsets)))
        duration = time.perf_counter() - t0
    return summarize(args, model, results, duration)


def _stats(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in values]
    out = {"mean": statistics.fmean(ms) if ms else 0.0, "median": statistics.median(ms) if ms else 0.0,
           "std": statistics.pstdev(ms) if len(ms) > 1 else 0.0}
    for q in percentiles:
        out[f"p{q:g}"] = percentile(ms, q)
    return out


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    events = sorted([(r.start, 1) for r in results if r.ok] + [(r.end, -1) for r in results if r.ok],
                    key=lambda e: (e[0], e[1]))
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def summarize(args: argparse.Namespace, model: str, results: Sequence[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    pct = [float(x) for x in args.percentiles.split(",") if x.strip()]
    total_in = sum(r.prompt_tokens or 0 for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1 and args.stream]
    return {
        "label": args.label, "base_url": args.base_url, "endpoint": args.endpoint, "model": model,
        "num_prompts": len(results), "request_rate": args.request_rate, "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "stream": args.stream, "input_len_words": args.input_len, "output_len": args.output_len,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": [r.error for r in results if not r.ok][:10],
        "duration_s": duration, "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
        "max_concurrent_requests": peak_concurrency(results),
        "empty_chunks": sum(r.empty_chunks for r in ok),
        "ttft_ms": _stats([r.ttft for r in ok], pct), "tpot_ms": _stats(tpots, pct),
        "itl_ms": _stats([g for r in ok for g in r.itl], pct), "e2el_ms": _stats([r.latency for r in ok], pct),
    }


def render(s: dict[str, Any]) -> str:
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"), ("Total input tokens", s["total_input_tokens"]),
            ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
            ("Peak concurrent requests", s["max_concurrent_requests"]),
            ("Timed chunks without text", s["empty_chunks"])]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL")):
        for stat, v in s[key].items():
            rows.append((f"{stat.capitalize() if not stat.startswith('p') else stat.upper()} {name} (ms)", f"{v:.2f}"))
    width = max(len(r[0]) for r in rows) + 2
    lines = ["=" * 20 + " Serving Benchmark Result " + "=" * 20]
    lines += [f"{name:<{width}}{value}" for name, value in rows]
    lines += [f"error: {e}" for e in s["errors"]]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    p.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s (Poisson); inf: all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of the gaps; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--input-len", type=int, default=32, help="words per random prompt")
    p.add_argument("--prompt-file", default=None, help="one prompt per line (cycled), instead of random words")
    p.add_argument("--output-len", type=int, default=32, help="max_tokens of every request")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="stream (SSE, the default) or --no-stream: one JSON response per request")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (rlt and vLLM) for fixed lengths")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    p.add_argument("--num-warmups", type=int, default=0, help="requests sent (one at a time) before timing")
    p.add_argument("--percentiles", default="50,95,99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--label", default="rlt")
    p.add_argument("--result-file", default=None, help="write the summary as JSON here")
    args = p.parse_args(argv)
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if not (math.isinf(args.request_rate) or args.request_rate > 0) or args.burstiness <= 0:
        p.error("--request-rate and --burstiness must be > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    summary = asyncio.run(run(args))
    print(render(summary), flush=True)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(summary, indent=1))
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
