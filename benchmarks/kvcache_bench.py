"""rlt-kvcache benchmarks: the three measurements of issue 12, each against its baseline.

(a) ``incremental``: requests with ``max_tokens`` M that stop (the client stops reading, as on a
    stop string) after about S tokens, at one KV budget: peak concurrent requests and throughput
    of full reservation (base engine) vs incremental allocation with preemption.
(b) ``prefix``: R requests sharing a P-token system prompt (plus a short own suffix): TTFT p50 and
    throughput without and with the prefix cache (one warm-up request publishes the prompt).
(c) ``priority``: a saturating low-priority load, then a few high-priority requests: the high
    ones' median completion time under ``--preemption-policy priority`` vs ``fcfs``.

CPU (tiny random model, seconds; checks the script, not performance)::

    PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-kvcache/src:. \\
        python -m benchmarks.kvcache_bench --preset cpu-tiny --out-dir /tmp/kvb

H200 (Ouro-1.4B shapes, random weights, bf16)::

    python -m benchmarks.kvcache_bench --model ouro-1.4b --dtype bfloat16 --out-dir $OUT

Writes ``results.json`` and ``results.md`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
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
    "h200": dict(
        incremental=dict(prompt=128, max_tokens=2048, stop_at=128, jitter=32, full_slots=16, requests=96,
                         max_num_seqs=128),
        prefix=dict(system=2048, suffix=32, out=32, requests=64),
        priority=dict(low=96, low_out=128, high=8, high_out=32, prompt=128, max_num_seqs=32, high_after=40),
    ),
    "cpu-tiny": dict(
        incremental=dict(prompt=16, max_tokens=256, stop_at=12, jitter=4, full_slots=2, requests=12,
                         max_num_seqs=16),
        prefix=dict(system=256, suffix=8, out=4, requests=8),
        priority=dict(low=12, low_out=24, high=2, high_out=6, prompt=16, max_num_seqs=4, high_after=8),
    ),
}


def log(msg: str) -> None:
    print(msg, flush=True)


class Bench:
    def __init__(self, model_dir: str, args) -> None:
        self.model_dir = model_dir
        self.args = args
        self.cache = CheckpointCache()
        self.platform = detect_platform(args.device)
        self.vocab = 300  # ids every tokenizer of the named configs has

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
        for label, pre in (("full_reservation", None), ("incremental", PreemptionOptions())):
            engine = self.engine(preemption=pre, **cfg)
            self.drive(engine, arrivals[:2], {k: 4 for k in stops})  # warm-up
            done, wall, peak, tokens = self.drive(engine, [(0, f"w{r}", pr, s) for _, r, pr, s in arrivals],
                                                  {f"w{k}": v for k, v in stops.items()})
            m = {x.name: x.value for x in engine.stats().feature_metrics}
            out[label] = {"peak_concurrent": peak, "wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall,
                          "preemptions": m.get("kv_preemptions", 0)}
            log(f"(a) {label}: peak concurrent {peak}, {tokens / wall:.1f} tok/s, {wall:.2f} s")
            del engine
        out["concurrency_ratio"] = out["incremental"]["peak_concurrent"] / out["full_reservation"]["peak_concurrent"]
        return out

    # -- (b) ---------------------------------------------------------------------------------------
    def prefix(self, p: dict) -> dict:
        rng = random.Random(2)
        system = self.tokens(p["system"], rng)
        prompts = [system + self.tokens(p["suffix"], rng) for _ in range(p["requests"])]
        sp = SamplingParams(max_tokens=p["out"], temperature=0.0, ignore_eos=True)
        max_len = p["system"] + p["suffix"] + p["out"]
        pages = -(-max_len // self.args.block_size)
        cfg = dict(num_kv_blocks=(p["requests"] + 2) * pages * 4, max_num_seqs=p["requests"], max_model_len=max_len,
                   max_num_batched_tokens=max(8192, max_len))
        out = dict(p)
        for label, on in (("no_cache", False), ("prefix_cache", True)):
            engine = self.engine(prefix=on, **cfg)
            self.drive(engine, [(0, "warm", system + self.tokens(p["suffix"], rng), sp)])  # publishes the system prompt
            done, wall, _, tokens = self.drive(engine, [(0, f"r{i}", pr, sp) for i, pr in enumerate(prompts)])
            ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in done.values()]
            m = {x.name: x.value for x in engine.stats().feature_metrics}
            out[label] = {"ttft_p50_s": statistics.median(ttft), "ttft_max_s": max(ttft), "wall_s": wall,
                          "tok_per_s": tokens / wall, "hit_rate": m.get("prefix_cache_hit_rate")}
            log(f"(b) {label}: TTFT p50 {statistics.median(ttft) * 1e3:.1f} ms, {tokens / wall:.1f} tok/s")
            del engine
        out["ttft_p50_speedup"] = out["no_cache"]["ttft_p50_s"] / out["prefix_cache"]["ttft_p50_s"]
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
        for policy in ("fcfs", "priority"):
            engine = self.engine(preemption=PreemptionOptions(policy=policy), **cfg)
            self.drive(engine, [(0, f"warm{i}", pr, sp.with_(max_tokens=4)) for i, (_, _, pr, sp) in enumerate(arrivals[:4])])
            done, wall, _, tokens = self.drive(engine, arrivals)
            lat = lambda o: o.metrics.finished_time - o.metrics.arrival_time  # noqa: E731
            hi = [lat(o) for rid, o in done.items() if rid.startswith("high")]
            lo = [lat(o) for rid, o in done.items() if rid.startswith("low")]
            m = {x.name: x.value for x in engine.stats().feature_metrics}
            out[policy] = {"high_median_s": statistics.median(hi), "low_median_s": statistics.median(lo),
                           "wall_s": wall, "tok_per_s": tokens / wall, "preemptions": m["kv_preemptions"]}
            log(f"(c) {policy}: high median {statistics.median(hi):.2f} s, low median {statistics.median(lo):.2f} s")
            del engine
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
                  f"{b['requests']} requests, system prompt {b['system']} + own {b['suffix']} tokens, out {b['out']}", "",
                  "| | TTFT p50 ms | TTFT max ms | tok/s | hit rate |", "|---|---|---|---|---|"]
        for k in ("no_cache", "prefix_cache"):
            r = b[k]
            lines.append(f"| {k} | {r['ttft_p50_s'] * 1e3:.1f} | {r['ttft_max_s'] * 1e3:.1f} | {r['tok_per_s']:.1f} | "
                         f"{r['hit_rate'] if r['hit_rate'] is not None else '-'} |")
        lines += ["", f"TTFT p50 speedup: {b['ttft_p50_speedup']:.1f}x", ""]
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
    if args.preset == "cpu-tiny" and args.model == "ouro-1.4b":
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
    for name in args.only or ["incremental", "prefix", "priority"]:
        res[name] = getattr(bench, name)(preset[name])
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2, default=str))
    (out / "results.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
