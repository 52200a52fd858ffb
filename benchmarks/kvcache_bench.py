"""rlt-kvcache benchmarks: the three measurements of issue 12, each against its baseline.

(a) ``incremental``: requests with ``max_tokens`` M that stop (the client stops reading, as on a
    stop string) after about S tokens, at one KV budget: peak concurrent requests and throughput
    of full reservation (base engine) vs incremental allocation with preemption.
(b) ``prefix``: R requests sharing a P-token system prompt (plus a short own suffix of S tokens)
    arrive together: TTFT p50 and throughput without the cache and with it, *hot* (one request
    published the system prompt before: every request hits) and *cold* (nothing published: the
    burst computes the prompt once, the others wait for its publication and hit). TTFT p50 "on
    hits" is over the requests whose prompt started at a cached prefix (seen by a step observer).
    Every measured pass follows a warm-up pass of the same shape (same R, P, S; other tokens), so
    the kernels' JIT specialisations for these shapes are compiled before timing (the first H200
    run warmed up with one request and timed the compilation of the hits' prompt kernels).
(c) ``priority``: a saturating low-priority load, then a few high-priority requests: the high
    ones' median completion time under ``--preemption-policy priority`` vs ``fcfs``.

CPU (tiny random model, seconds; checks the script, not performance)::

    PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-kvcache/src:. \\
        python -m benchmarks.kvcache_bench --preset cpu-tiny --out-dir /tmp/kvb

H200 (Ouro-1.4B shapes, random weights, bf16)::

    python -m benchmarks.kvcache_bench --model ouro-1.4b --dtype bfloat16 --out-dir $OUT

Each engine is dropped and its KV pool checked gone before the next is built. Writes
``results.json`` and ``results.md`` into ``--out-dir`` after each workload.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
import weakref
from pathlib import Path

import torch

from benchmarks.bench_model import NAMED_CONFIGS, write_random_checkpoint
from benchmarks.report import environment
from benchmarks.workload import CheckpointCache
from rlt.kvcache.feature import FEATURES
from rlt.kvcache.options import PreemptionOptions, PrefixCacheOptions
from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.composition import plan_composition
from rlt.platform.platforms import detect_platform

PRESETS = {
    # name: (incremental, prefix, priority) parameters
    # prefix budget: --max-num-batched-tokens (None: the engine default, max(8192, max_model_len))
    "h200": dict(
        incremental=dict(prompt=128, max_tokens=2048, stop_at=128, jitter=32, full_slots=16, requests=96,
                         max_num_seqs=128),
        prefix=dict(system=2048, suffix=32, out=32, requests=64, budget=None),
        priority=dict(low=96, low_out=128, high=8, high_out=32, prompt=128, max_num_seqs=32, high_after=40),
    ),
    # the H200 shapes scaled for the tiny CPU model: (b) keeps 64 requests, a system prompt of 32
    # pages and a budget that fits 3 of its prompts (as 8,192 fits 3 of 2,080)
    "cpu-shape": dict(
        incremental=dict(prompt=32, max_tokens=512, stop_at=32, jitter=8, full_slots=4, requests=24,
                         max_num_seqs=32),
        prefix=dict(system=512, suffix=16, out=8, requests=64, budget=2048),
        priority=dict(low=24, low_out=32, high=2, high_out=8, prompt=32, max_num_seqs=8, high_after=16),
    ),
    "cpu-tiny": dict(
        incremental=dict(prompt=16, max_tokens=256, stop_at=12, jitter=4, full_slots=2, requests=12,
                         max_num_seqs=16),
        prefix=dict(system=256, suffix=8, out=4, requests=8, budget=None),
        priority=dict(low=12, low_out=24, high=2, high_out=6, prompt=16, max_num_seqs=4, high_after=8),
    ),
}


def log(msg: str) -> None:
    print(msg, flush=True)


def feature_metrics(engine) -> dict:
    return {x.name: x.value for x in engine.stats().feature_metrics}


class BurstWatch:
    """Step observer of one burst: step end times, where each request's prompt started (> 0: it hit
    the prefix cache) and the prompt positions computed (one per row position and loop)."""

    def __init__(self) -> None:
        self.step_end: list[float] = []
        self.prompt_start: dict[str, int] = {}
        self.prompt_row_tokens = 0

    def on_step(self, batch, result) -> None:
        self.step_end.append(time.perf_counter())
        for r in batch.rows:
            if r.in_prompt:
                self.prompt_row_tokens += r.length
                if r.depth == 0:
                    self.prompt_start.setdefault(r.request.request_id, r.start)


class Bench:
    def __init__(self, model_dir: str, args) -> None:
        self.model_dir = model_dir
        self.args = args
        self.cache = CheckpointCache()
        self.platform = detect_platform(args.device)
        self.vocab = 300  # ids every tokenizer of the named configs has

    def with_engine(self, fn, **kw):
        """``fn(engine)`` on a fresh engine; the engine is dropped when ``fn`` returns and its KV pool
        must be gone before anything else is allocated (results must not reference the engine)."""
        engine = self.engine(**kw)
        pool = weakref.ref(engine.ctx.cache.k)
        try:
            out = fn(engine)
        except BaseException:
            del engine
            raise
        del engine
        gc.collect()
        if pool() is not None:
            raise RuntimeError("kvcache_bench: the previous engine's KV pool is still referenced after the engine "
                               "was dropped; the next engine would not fit")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            log(f"    engine freed: {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated on the device")
        return out

    def engine(self, *, preemption: PreemptionOptions | None = None, prefix: bool = False, **cfg):
        gc.collect()  # the previous engine's KV pool goes before this one is allocated
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        enabled = {"preemption": preemption is not None, "prefix_cache": prefix}
        options = {"preemption": preemption} if preemption is not None else {}
        if prefix:
            options["prefix_cache"] = PrefixCacheOptions()
        plan = plan_composition(self.platform, FEATURES, enabled=enabled, options=options)
        config = EngineConfig(model=self.model_dir, device=self.args.device, dtype=self.args.dtype,
                              attention_backend=self.args.attention_backend, block_size=self.args.block_size, **cfg)
        engine = plan.assembly.build_engine(config, load_checkpoint=self.cache.load)
        engine.features = plan.table
        return engine

    def tokens(self, n: int, rng: random.Random) -> list[int]:
        return [rng.randrange(3, self.vocab) for _ in range(n)]

    def sync(self, engine) -> None:
        if engine.device.type == "cuda":
            torch.cuda.synchronize()

    def drive(self, engine, arrivals, stop_at: dict[str, int] | None = None):
        """Submit ``arrivals`` [(step, id, prompt, params)] at their step; run until idle. Returns
        (outputs by id, wall seconds, peak running, tokens generated)."""
        pending = sorted(arrivals, key=lambda a: a[0])
        done, step, peak, tokens = {}, 0, 0, 0
        self.sync(engine)
        t0 = time.perf_counter()
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][0] <= step:
                _, rid, prompt, sp = pending.pop(0)
                engine.add_request(rid, prompt, sp)
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
                    tokens += len(o.token_ids)
                elif stop_at is not None and len(o.token_ids) >= stop_at[o.request_id]:
                    final = engine.abort_request(o.request_id)  # the client stops reading here
                    done[o.request_id] = final
                    tokens += len(final.token_ids)
            peak = max(peak, engine.stats().num_running)
            step += 1
        self.sync(engine)
        return done, time.perf_counter() - t0, peak, tokens

    # -- (a) ---------------------------------------------------------------------------------------
    def incremental(self, p: dict) -> dict:
        bs = self.args.block_size
        planes = 4
        per_request_full = -(-(p["prompt"] + p["max_tokens"] - 1) // bs) * planes
        budget = p["full_slots"] * per_request_full
        rng = random.Random(1)
        prompts = [self.tokens(p["prompt"], rng) for _ in range(p["requests"])]
        stops = {f"r{i}": p["stop_at"] + rng.randint(-p["jitter"], p["jitter"]) for i in range(p["requests"])}
        sp = SamplingParams(max_tokens=p["max_tokens"], temperature=0.0, ignore_eos=True)
        arrivals = [(0, f"r{i}", pr, sp) for i, pr in enumerate(prompts)]
        cfg = dict(num_kv_blocks=budget, max_num_seqs=p["max_num_seqs"], max_model_len=p["prompt"] + p["max_tokens"],
                   max_num_batched_tokens=max(8192, p["prompt"]))
        out = {"kv_blocks": budget, "blocks_per_request_full_reservation": per_request_full, **p}
        def run(engine) -> dict:
            self.drive(engine, arrivals[:2], {k: 4 for k in stops})  # warm-up
            done, wall, peak, tokens = self.drive(engine, [(0, f"w{r}", pr, s) for _, r, pr, s in arrivals],
                                                  {f"w{k}": v for k, v in stops.items()})
            return {"peak_concurrent": peak, "wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall,
                    "preemptions": feature_metrics(engine).get("kv_preemptions", 0)}

        for label, pre in (("full_reservation", None), ("incremental", PreemptionOptions())):
            r = out[label] = self.with_engine(run, preemption=pre, **cfg)
            log(f"(a) {label}: peak concurrent {r['peak_concurrent']}, {r['tok_per_s']:.1f} tok/s, {r['wall_s']:.2f} s")
        out["concurrency_ratio"] = out["incremental"]["peak_concurrent"] / out["full_reservation"]["peak_concurrent"]
        return out

    # -- (b) ---------------------------------------------------------------------------------------
    def burst(self, engine, prompts: list[list[int]], sp: SamplingParams) -> dict:
        """All ``prompts`` arrive before the first step; run until idle. TTFT and steps to the first
        token per request, split into hits (prompt started at a cached prefix) and the others."""
        watch = BurstWatch()
        engine.add_observer(watch)
        ids = [f"b{i}" for i in range(len(prompts))]
        self.sync(engine)
        t0 = time.perf_counter()
        for rid, pr in zip(ids, prompts):
            engine.add_request(rid, pr, sp)
        done, first_step, tokens, step = {}, {}, 0, 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.token_ids and o.request_id not in first_step:
                    first_step[o.request_id] = step
                if o.finished:
                    done[o.request_id] = o
                    tokens += len(o.token_ids)
            step += 1
        self.sync(engine)
        wall = time.perf_counter() - t0
        engine.remove_observer(watch)
        ttft = {rid: o.metrics.first_token_time - o.metrics.arrival_time for rid, o in done.items()}
        hits = [rid for rid in ids if watch.prompt_start.get(rid, 0) > 0]
        group = hits or ids  # TTFT "on hits"; without any hit, over every request
        steps_p50 = statistics.median(first_step[r] for r in group)
        ends = [t0] + watch.step_end
        step_s = [b - a for a, b in zip(ends, ends[1:])]
        upto = step_s[: int(steps_p50) + 1]  # the steps before the median hit's first token
        return {"requests": len(ids), "hits": len(hits), "ttft_p50_s": statistics.median(ttft.values()),
                "ttft_hits_p50_s": statistics.median(ttft[r] for r in group), "ttft_max_s": max(ttft.values()),
                "first_token_step_p50": steps_p50, "steps": step,
                "step_ms_before_first_token": 1e3 * statistics.median(upto),
                "first_step_ms": 1e3 * step_s[0], "prompt_row_tokens": watch.prompt_row_tokens,
                "wall_s": wall, "tok_per_s": tokens / wall}

    def prefix(self, p: dict) -> dict:
        rng = random.Random(2)
        n = p["requests"]
        sp = SamplingParams(max_tokens=p["out"], temperature=0.0, ignore_eos=True)

        def burst_of(system: list[int]) -> list[list[int]]:
            return [system + self.tokens(p["suffix"], rng) for _ in range(n)]

        max_len = p["system"] + p["suffix"] + p["out"]
        pages = -(-max_len // self.args.block_size)
        cfg = dict(num_kv_blocks=(n + 2) * pages * 4, max_num_seqs=n, max_model_len=max_len)
        if p.get("budget"):
            cfg["max_num_batched_tokens"] = p["budget"]
        system = self.tokens(p["system"], rng)

        def no_cache(engine) -> dict:
            self.burst(engine, burst_of(system), sp)  # warm-up: the measured shape, step for step
            r = self.burst(engine, burst_of(system), sp)
            return r | {"budget": engine.max_num_batched_tokens}

        def cached(engine) -> tuple[dict, dict]:
            self.drive(engine, [(0, "publish", system + self.tokens(p["suffix"], rng), sp)])  # publishes it
            self.burst(engine, burst_of(system), sp)  # warm-up: every request a hit, as measured
            hot = self.burst(engine, burst_of(system), sp)
            self.burst(engine, burst_of(self.tokens(p["system"], rng)), sp)  # warm-up of a cold burst
            cold = self.burst(engine, burst_of(self.tokens(p["system"], rng)), sp)
            m = feature_metrics(engine)
            return hot, cold | {"inflight_waits": m.get("prefix_cache_inflight_waits"),
                                "hit_rate_all_passes": m.get("prefix_cache_hit_rate")}

        out = dict(p)
        out["no_cache"] = self.with_engine(no_cache, prefix=False, **cfg)
        out["prefix_hot"], out["prefix_cold"] = self.with_engine(cached, prefix=True, **cfg)
        base = out["no_cache"]["ttft_p50_s"]
        for k in ("no_cache", "prefix_hot", "prefix_cold"):
            r = out[k]
            log(f"(b) {k}: hits {r['hits']}/{r['requests']}, TTFT p50 {r['ttft_p50_s'] * 1e3:.1f} ms (hits "
                f"{r['ttft_hits_p50_s'] * 1e3:.1f} ms), first token at step {r['first_token_step_p50']:g}, "
                f"{r['step_ms_before_first_token']:.1f} ms/step before it, {r['tok_per_s']:.1f} tok/s")
        out["ttft_p50_speedup"] = base / out["prefix_hot"]["ttft_hits_p50_s"]
        out["ttft_p50_speedup_cold"] = base / out["prefix_cold"]["ttft_hits_p50_s"]
        return out

    # -- (c) ---------------------------------------------------------------------------------------
    def priority(self, p: dict) -> dict:
        rng = random.Random(3)
        low = SamplingParams(max_tokens=p["low_out"], temperature=0.0, ignore_eos=True, priority=10)
        high = SamplingParams(max_tokens=p["high_out"], temperature=0.0, ignore_eos=True, priority=0)
        arrivals = [(0, f"low{i}", self.tokens(p["prompt"], rng), low) for i in range(p["low"])]
        arrivals += [(p["high_after"] + 4 * i, f"high{i}", self.tokens(p["prompt"], rng), high) for i in range(p["high"])]
        max_len = p["prompt"] + p["low_out"]
        pages = -(-max_len // self.args.block_size)
        cfg = dict(num_kv_blocks=p["max_num_seqs"] * pages * 4, max_num_seqs=p["max_num_seqs"], max_model_len=max_len,
                   max_num_batched_tokens=8192)
        out = dict(p)
        def run(engine) -> dict:
            self.drive(engine, [(0, f"warm{i}", pr, sp.with_(max_tokens=4)) for i, (_, _, pr, sp) in enumerate(arrivals[:4])])
            done, wall, _, tokens = self.drive(engine, arrivals)
            lat = lambda o: o.metrics.finished_time - o.metrics.arrival_time  # noqa: E731
            hi = [lat(o) for rid, o in done.items() if rid.startswith("high")]
            lo = [lat(o) for rid, o in done.items() if rid.startswith("low")]
            return {"high_median_s": statistics.median(hi), "low_median_s": statistics.median(lo),
                    "wall_s": wall, "tok_per_s": tokens / wall, "preemptions": feature_metrics(engine)["kv_preemptions"]}

        for policy in ("fcfs", "priority"):
            r = out[policy] = self.with_engine(run, preemption=PreemptionOptions(policy=policy), **cfg)
            log(f"(c) {policy}: high median {r['high_median_s']:.2f} s, low median {r['low_median_s']:.2f} s")
        return out


def markdown(res: dict) -> str:
    a, b, c = res.get("incremental"), res.get("prefix"), res.get("priority")
    lines = [f"# rlt-kvcache benchmarks ({res['model']}, {res['dtype']}, {res['env'].get('device', '')})", ""]
    if a:
        lines += ["## (a) incremental allocation vs full reservation (same KV budget)", "",
                  f"{a['requests']} requests, prompt {a['prompt']}, max_tokens {a['max_tokens']}, stop after "
                  f"{a['stop_at']}±{a['jitter']} tokens; {a['kv_blocks']} KV blocks", "",
                  "| allocation | peak concurrent | tok/s | wall s | preemptions |", "|---|---|---|---|---|"]
        for k in ("full_reservation", "incremental"):
            r = a[k]
            lines.append(f"| {k} | {r['peak_concurrent']} | {r['tok_per_s']:.1f} | {r['wall_s']:.2f} | {r['preemptions']} |")
        lines += ["", f"concurrency ratio: {a['concurrency_ratio']:.2f}x", ""]
    if b:
        lines += ["## (b) shared system prompt: prefix cache", "",
                  f"{b['requests']} requests arriving together, system prompt {b['system']} + own {b['suffix']} "
                  f"tokens, out {b['out']}; step budget {b['no_cache']['budget']} tokens. hot: the system prompt "
                  "was published before; cold: nothing was (the burst computes it once). Each pass after a "
                  "warm-up pass of the same shape.", "",
                  "| | hits | TTFT p50 ms (hits) | TTFT p50 ms (all) | TTFT max ms | 1st token at step (p50) | "
                  "ms/step before it | prompt row-tokens | tok/s |", "|---|---|---|---|---|---|---|---|---|"]
        for k in ("no_cache", "prefix_hot", "prefix_cold"):
            r = b[k]
            hits = f"{r['ttft_hits_p50_s'] * 1e3:.1f}" if r["hits"] else "-"
            lines.append(f"| {k} | {r['hits']}/{r['requests']} | {hits} | {r['ttft_p50_s'] * 1e3:.1f} | "
                         f"{r['ttft_max_s'] * 1e3:.1f} | {r['first_token_step_p50']:g} | "
                         f"{r['step_ms_before_first_token']:.1f} | {r['prompt_row_tokens']} | {r['tok_per_s']:.1f} |")
        lines += ["", f"TTFT p50 on hits vs without the cache: hot {b['ttft_p50_speedup']:.1f}x, "
                      f"cold {b['ttft_p50_speedup_cold']:.1f}x", ""]
    if c:
        lines += ["## (c) priorities under a saturating low-priority load", "",
                  f"{c['low']} low-priority requests ({c['low_out']} tokens), {c['high']} high-priority ({c['high_out']} "
                  f"tokens) arriving from step {c['high_after']}; {c['max_num_seqs']} slots", "",
                  "| policy | high median s | low median s | tok/s | preemptions |", "|---|---|---|---|---|"]
        for k in ("fcfs", "priority"):
            r = c[k]
            lines.append(f"| {k} | {r['high_median_s']:.2f} | {r['low_median_s']:.2f} | {r['tok_per_s']:.1f} | "
                         f"{r['preemptions']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="ouro-1.4b", help="checkpoint directory or named configuration")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="workload sizes (default: h200)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--only", nargs="*", choices=["incremental", "prefix", "priority"], default=None)
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset or ("cpu-tiny" if args.model == "ouro-tiny" else "h200")]
    if (args.preset or "").startswith("cpu") and args.model == "ouro-1.4b":
        args.model = "ouro-tiny"
    model_dir = args.model
    if args.model in NAMED_CONFIGS:
        work = Path(args.work_dir or tempfile.mkdtemp(prefix="rlt-kvb-"))
        model_dir = str(work / args.model)
        if not (Path(model_dir) / "config.json").exists():
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            write_random_checkpoint(model_dir, args.model, device=dev)
    bench = Bench(model_dir, args)
    res = {"model": args.model, "dtype": args.dtype, "preset": args.preset or "h200",
           "env": environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.only or ["incremental", "priority", "prefix"]:  # the largest KV pool last
        t = time.perf_counter()
        res[name] = getattr(bench, name)(preset[name])
        res[name]["elapsed_s"] = time.perf_counter() - t
        (out / "results.json").write_text(json.dumps(res, indent=2, default=str))  # what is done survives a timeout
        (out / "results.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
