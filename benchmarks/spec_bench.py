"""Self-speculation benchmark (issue 13): tokens/s against measured acceptance, synchronous and
overlapped rounds (``async_self_spec``), against plain decoding of the same build.

One run does everything (``--preset h200``: Ouro-1.4B shapes, random weights, bf16, C = 1, 256
output tokens; about 6 minutes on an H200, bounded by ``--cap`` per run and ``--deadline``):

1. writes a random checkpoint of the named shapes once; every engine loads it from one cache,
   with its loop-update norms scaled in memory (:func:`rlt.spec.bench_checkpoint.scale_weights`:
   smaller scale, each loop moves the hidden state less, drafts agree more);
2. plain baselines (speed does not depend on the scale): the eager build (self_spec installed,
   rlt-decode off: every step eager) and the default build (rlt-decode's static buffers, graphs
   where the platform has them, and the pipeline: decode steps replay graphs — speculative ones
   too, host-synchronously);
3. calibration: the per-draft acceptance of overlapped chains at d = 1 and d = 2 for each
   candidate scale (``--scales``, short runs); for each target acceptance (``--targets``, at
   d = 2, in order) the unused candidate closest to it;
4. C = ``--big-c`` (64; 0 skips it) at the highest-acceptance chosen scale, default build: plain vs adaptive
   overlapped speculation (engine default K = max K, d = 2) with the default ``max_running``
   gate, and with the gate off (``max_running`` 0);
5. C = 1 at each chosen scale (no new scale starts after ``--deadline`` seconds), default build:
   synchronous and overlapped rounds for every K in ``--ks`` and d in ``--ds`` (fixed K), and
   overlapped adaptive K (K_max = max K, d = 2) with the default ``step_cost`` and with the measured cost of
   a speculative step in default-build plain steps (``adaptive@<cost>``). Each run reports decode tokens/s (TTFT
   excluded), its speedup over both plain baselines, the measured per-draft acceptance, steps
   per token (measured, and the cost model's at the measured acceptance: docs/spec.md) and ms
   per step.

A run is cut ``--cap`` seconds after its first token (its rate is then over what it produced;
``capped`` in the JSON). Every measured configuration runs ``--reps`` times (3 on the H200) after
its engine's warm-up; the median is reported. Writes ``spec_bench.json`` into ``--out-dir`` and prints the table last.

H200 (one device call):
    python -m benchmarks.spec_bench --preset h200 --out-dir "$OUT/spec"
CPU (the same logic on ouro-tiny, about a minute):
    python -m benchmarks.spec_bench --preset cpu --out-dir /tmp/spec-bench
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path

import attrs
import torch

from benchmarks.bench_model import write_random_checkpoint
from benchmarks.workload import CheckpointCache
from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.composition import plan_composition
from rlt.platform.platforms import detect_platform
from rlt.spec.adaptive import async_steps_per_token, sync_steps_per_token
from rlt.spec.bench_checkpoint import scale_weights
from rlt.spec.feature import SpecOptions, features as spec_features
from rlt.spec.stats import SpecStats

PRESETS = {
    "h200": dict(model="ouro-1.4b", device="cuda", dtype="bfloat16", input_len=32, out=256, ks="2,4,8", ds="1,2",
                 scales="1.0,0.3,0.1,0.05,0.02,0.01,0.004,0.002", targets="0.8,0.95,0.6", calib_out=48, cap=5.0,
                 big_c=64, deadline=330.0, reps=3),
    "cpu": dict(model="ouro-tiny", device="cpu", dtype="float32", input_len=16, out=48, ks="2,4,8", ds="1,2",
                scales="1.0,0.1,0.03,0.01", targets="0.8,0.95,0.6", calib_out=24, cap=3.0, big_c=12,
                deadline=600.0, reps=1),
}


def _ints(s: str) -> list[int]:
    return [int(x) for x in str(s).split(",") if x]


def _floats(s: str) -> list[float]:
    return [float(x) for x in str(s).split(",") if x]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class ScaledLoader:
    """The engine's checkpoint loader: the source weights loaded once, scaled in memory per engine."""

    def __init__(self) -> None:
        self.cache = CheckpointCache()
        self.scale = 1.0

    def load(self, path, *, dtype, device="cpu"):
        ck = self.cache.load(path, dtype=dtype, device=device)
        return ck if self.scale == 1.0 else attrs.evolve(ck, weights=scale_weights(ck.weights, self.scale))


@attrs.define
class Bench:
    args: argparse.Namespace
    src: Path
    loader: ScaledLoader
    decode_features: list
    platform: object

    def engine(self, scale: float, *, c: int = 1, overlap: bool = False, adaptive: bool = False,
               decode: bool = True, options: dict | None = None):
        a = self.args
        gc.collect()
        if a.device == "cuda":
            torch.cuda.empty_cache()
        self.loader.scale = scale
        cfg = EngineConfig(model=str(self.src), device=a.device, dtype=a.dtype, max_num_seqs=c,
                           max_model_len=2 * a.input_len + a.out + 16, max_num_batched_tokens=a.budget)
        feats = spec_features() + (self.decode_features if decode else [])
        enabled = {"self_spec": True, "async_self_spec": overlap}
        if not decode:
            enabled.update({f.name: False for f in self.decode_features})
        chain_lag = {} if a.chain_lag is None else {"chain_lag": a.chain_lag}
        feature_options = {"self_spec": SpecOptions(adaptive=adaptive,
                                                    **{"width": a.chain_width, **chain_lag, **(options or {})})}
        if decode and a.pipeline_depth is not None:
            pipeline = next(f for f in self.decode_features if f.name == "pipeline")
            feature_options["pipeline"] = pipeline.options(depth=a.pipeline_depth)
        plan = plan_composition(self.platform, feats, enabled=enabled, options=feature_options, model=str(self.src))
        engine = plan.assembly.build_engine(cfg, load_checkpoint=self.loader.load)
        engine.features = plan.table
        engine.spec_stats = SpecStats()
        engine.add_observer(engine.spec_stats)
        return engine

    def warm(self, engine, c: int, spec) -> None:
        """Compile kernels and capture graphs of the shapes a measured run meets: plain steps at
        both context buckets (a short and a long prompt), then speculative steps (``spec``)."""
        a = self.args
        for length in (a.input_len, a.input_len + a.out):
            self.run(engine, c, 4, {"num_tokens": 0}, prompt_len=length, cap=None)
        self.run(engine, c, 16, spec, cap=None)

    def measure(self, engine, c: int, out: int, spec) -> dict:
        """``run`` repeated ``--reps`` times (after the caller's warm-up): the run with the median
        tokens/s, with every repetition's tokens/s in ``reps_tokens_per_s``."""
        runs = sorted((self.run(engine, c, out, spec) for _ in range(self.args.reps)),
                      key=lambda r: r["decode_tokens_per_s"])
        r = dict(runs[len(runs) // 2])
        r["reps_tokens_per_s"] = [x["decode_tokens_per_s"] for x in runs]
        return r

    def run(self, engine, c: int, out: int, spec, *, prompt_len: int | None = None, cap: float | None = -1.0,
            seed: int = 0) -> dict:
        """C requests of ``out`` greedy tokens; decode tokens/s from the moment every request has
        its first token (TTFT excluded), cut at ``cap`` seconds (-1: the preset's)."""
        a = self.args
        cap = a.cap if cap == -1.0 else cap
        rng = random.Random(seed)
        vocab = min(engine.model.shape.vocab_size, 30000)
        stats = engine.spec_stats
        sync = engine.ctx.platform.synchronize
        ids = []
        for i in range(c):
            rid = f"{time.monotonic_ns()}-{i}"
            ids.append(rid)
            prompt = [rng.randrange(3, vocab) for _ in range(prompt_len or a.input_len)]
            engine.add_request(rid, prompt, SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True,
                                                           speculation=spec))
        counts = dict.fromkeys(ids, 0)
        sync()
        t0 = time.perf_counter()
        t_first = None
        stats.reset()
        steps0 = tokens_first = 0
        judged0 = (0, 0)
        capped = False
        while engine.has_unfinished_requests():
            for o in engine.step():
                counts[o.request_id] = len(o.token_ids)
            if t_first is None and all(counts.values()):
                sync()
                t_first, steps0, tokens_first = time.perf_counter(), stats.steps, sum(counts.values())
                judged0 = (stats.accepted, stats.rejected)
            if cap is not None and t_first is not None and time.perf_counter() - t_first > cap:
                capped = True
                for rid in ids:
                    engine.abort_request(rid)
                break
        sync()
        t1 = time.perf_counter()
        tokens = sum(counts.values()) - tokens_first
        steps = stats.steps - steps0
        acc, rej = stats.accepted - judged0[0], stats.rejected - judged0[1]
        dt = t1 - (t_first or t0)
        return {"decode_tokens_per_s": tokens / dt if dt > 0 else float("nan"), "decode_tokens": tokens,
                "decode_seconds": dt, "decode_steps": steps, "ttft_s": (t_first or t1) - t0,
                "steps_per_token": steps * c / tokens if tokens else float("nan"),
                "ms_per_step": 1e3 * dt / steps if steps else float("nan"),
                "acceptance": acc / (acc + rej) if acc + rej else float("nan"), "judged_drafts": acc + rej,
                "capped": capped}


def parse_args(argv=None, *, prog: str = "python -m benchmarks.spec_bench", description: str = __doc__,
               extra=None) -> argparse.Namespace:
    """The benchmark's options with the preset's values filled in (``extra(ap)`` adds a caller's own)."""
    ap = argparse.ArgumentParser(prog=prog, description=description.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    for name, typ in (("model", str), ("device", str), ("dtype", str), ("input_len", int), ("out", int),
                      ("ks", str), ("ds", str), ("scales", str), ("targets", str), ("calib_out", int),
                      ("cap", float), ("big_c", int), ("deadline", float), ("reps", int)):
        ap.add_argument(f"--{name.replace('_', '-')}", type=typ, default=None, help="(preset's value)")
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--pipeline-depth", type=int, default=None,
                    help="rlt-decode's --pipeline-depth for every default-build engine (default: its own); overlapped "
                         "chains read verdicts this many steps late")
    ap.add_argument("--chain-lag", type=int, default=None,
                    help="--self-spec-chain-lag for every engine (default: its own): steps in flight while a chain "
                         "is open (at most the pipeline's depth)")
    ap.add_argument("--chain-width", type=int, default=1,
                    help="--self-spec-width for every engine (default 1: plain chains, whose per-draft acceptance the "
                         "tables report; wide chains against plain ones: benchmarks/spec_wide.py)")
    ap.add_argument("--work-dir")
    ap.add_argument("--out-dir", default="benchmarks/results/spec-latest")
    if extra is not None:
        extra(ap)
    args = ap.parse_args(argv)
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def decode_features() -> list:
    """rlt-decode's features when installed (the default build), else none (the eager build only)."""
    try:
        from rlt.decode.feature import FEATURES
    except ImportError:
        return []
    return list(FEATURES)


def main(argv=None) -> dict:
    args = parse_args(argv)
    ks, ds = _ints(args.ks), _ints(args.ds)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="spec-bench-"))
    t_start = time.perf_counter()
    log(f"writing {args.model} random checkpoint")
    src = write_random_checkpoint(work / "src", args.model)
    bench = Bench(args, src, ScaledLoader(), decode_features(), detect_platform(args.device))
    res: dict = {"args": vars(args), "baselines": {}, "calibration": [], "c1": [], "big_c": []}

    def save():
        res["seconds"] = time.perf_counter() - t_start
        (out_dir / "spec_bench.json").write_text(json.dumps(res, indent=1, default=str))

    # -- 2. plain baselines ------------------------------------------------------------------
    for name, decode in (("plain_eager", False), ("plain_default", True)):
        if decode and not bench.decode_features:
            continue
        engine = bench.engine(1.0, decode=decode)
        bench.warm(engine, 1, {"num_tokens": 2, "draft_loops": 1})
        r = bench.measure(engine, 1, args.out, None)
        r["components"] = engine.assembly.describe()
        describe = getattr(engine.ctx.parts.executor, "describe", None)
        r["executor"] = describe() if callable(describe) else None
        res["baselines"][name] = r
        log(f"{name}: {r['decode_tokens_per_s']:.1f} tok/s, {r['ms_per_step']:.2f} ms/step")
        engine = None  # dropped before the next build (which collects it)
    save()
    eager = res["baselines"]["plain_eager"]["decode_tokens_per_s"]
    default = res["baselines"].get("plain_default", {}).get("decode_tokens_per_s", eager)

    # -- 3. calibration ------------------------------------------------------------------------
    for scale in _floats(args.scales):
        engine = bench.engine(scale, overlap=True)
        row = {"scale": scale}
        for d in ds:
            r = bench.run(engine, 1, args.calib_out, {"num_tokens": 8, "draft_loops": d}, cap=None, seed=1)
            row[f"acceptance_d{d}"] = r["acceptance"]
        res["calibration"].append(row)
        log("calibration " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
        engine = None  # dropped before the next build (which collects it)
    save()
    ref_d = 2 if 2 in ds else ds[-1]
    chosen: list[float] = []
    for target in _floats(args.targets):
        free = [r for r in res["calibration"] if r["scale"] not in chosen] or res["calibration"]
        best = min(free, key=lambda r: abs(r[f"acceptance_d{ref_d}"] - target))
        chosen.append(best["scale"])
    res["chosen_scales"] = chosen
    log(f"chosen scales {chosen}")

    # -- 5. C = 1 (run after 4) -----------------------------------------------------------------------------
    def record(scale, mode, k, d, r, lag=0):
        # lag: steps until a chain's verdict is read (the pipeline's depth when chains are lagged)
        if not r["judged_drafts"]:
            model = float("nan")
        elif mode == "sync":
            model = sync_steps_per_token(r["acceptance"], k, d, 4)
        else:
            model = async_steps_per_token(r["acceptance"], k, d, 4, lag)
        r.update(scale=scale, mode=mode, k=k, d=d, model_steps_per_token=model, verdict_lag=lag,
                 speedup_vs_eager=r["decode_tokens_per_s"] / eager,
                 speedup_vs_default=r["decode_tokens_per_s"] / default)
        res["c1"].append(r)
        log(f"scale {scale} {mode:>8} K={k} d={d}: {r['decode_tokens_per_s']:7.1f} tok/s  x{r['speedup_vs_eager']:.2f} "
            f"eager x{r['speedup_vs_default']:.2f} default  a={r['acceptance']:.3f}  steps/token "
            f"{r['steps_per_token']:.2f} (model {model:.2f})  {r['ms_per_step']:.2f} ms/step")
        save()

    def c1(scale):
        for overlap in (False, True):
            engine = bench.engine(scale, overlap=overlap)
            bench.warm(engine, 1, {"num_tokens": 2, "draft_loops": 1})
            lag = engine.ctx.parts.scheduler.lag if overlap else 0
            for k in ks:
                for d in ds:
                    record(scale, "async" if overlap else "sync", k, d,
                           bench.measure(engine, 1, args.out, {"num_tokens": k, "draft_loops": d}), lag)
            engine = None  # dropped before the next build (which collects it)
        # adaptive K as shipped (the composition's default step_cost), and with step_cost = the ratio
        # just measured against the default build's plain steps (what --self-spec-step-cost is for)
        spec_ms = sorted(r["ms_per_step"] for r in res["c1"] if r["scale"] == scale)
        measured = spec_ms[len(spec_ms) // 2] / res["baselines"].get("plain_default", res["baselines"]["plain_eager"])[
            "ms_per_step"]
        measured = max(round(measured, 2), 0.01)
        for mode, cost in (("adaptive", None), (f"adaptive@{measured}", measured)):
            engine = bench.engine(scale, overlap=True, adaptive=True,
                                  options={"num_tokens": max(ks), "draft_loops": ref_d, "step_cost": cost})
            bench.warm(engine, 1, None)
            r = bench.measure(engine, 1, args.out, None)
            r["step_cost"] = cost if cost is not None else "default"
            record(scale, mode, max(ks), ref_d, r, engine.ctx.parts.scheduler.lag)
            engine = None  # dropped before the next build (which collects it)

    # -- 4. C = big_c ---------------------------------------------------------------------------
    top = max(chosen, key=lambda s: next(r[f"acceptance_d{ref_d}"] for r in res["calibration"] if r["scale"] == s))
    c = args.big_c
    for gate in ("default", "off") if c > 0 else ():  # --big-c 0 skips this part
        options = {"num_tokens": max(ks), "draft_loops": ref_d}
        if gate == "off":
            options["max_running"] = 0
        engine = bench.engine(top, c=c, overlap=True, adaptive=True, options=options)
        bench.warm(engine, c, None)
        rows = {}
        if gate == "default":
            rows["plain"] = bench.measure(engine, c, args.out, {"num_tokens": 0})
        rows[f"adaptive_gate_{gate}"] = bench.measure(engine, c, args.out, None)
        engine = None  # dropped before the next build (which collects it)
        for name, r in rows.items():
            r.update(scale=top, c=c, run=name, max_running=SpecOptions(**options).max_running)
            res["big_c"].append(r)
            log(f"C={c} {name}: {r['decode_tokens_per_s']:.1f} tok/s a={r['acceptance']:.3f} "
                f"{r['ms_per_step']:.2f} ms/step")
    for r in res["big_c"]:
        r["speedup_vs_plain"] = r["decode_tokens_per_s"] / next(
            b for b in res["big_c"] if b["run"] == "plain")["decode_tokens_per_s"]
    save()

    res["skipped_scales"] = []
    for scale in chosen:  # in the order of --targets
        if time.perf_counter() - t_start > args.deadline:
            res["skipped_scales"].append(scale)
            log(f"deadline ({args.deadline:.0f} s) passed: scale {scale} skipped")
            continue
        c1(scale)
    save()
    _print_table(res)
    return res


def _print_table(res: dict) -> None:
    b = res["baselines"]
    print("\nplain: " + ", ".join(f"{k} {v['decode_tokens_per_s']:.1f} tok/s ({v['ms_per_step']:.2f} ms/step)"
                                  for k, v in b.items()))
    print("calibration (per-draft acceptance of overlapped chains): " + "; ".join(
        ", ".join(f"{k}={v:.3g}" for k, v in r.items()) for r in res["calibration"]))
    print("\n| scale | mode | K | d | acceptance | tok/s | x eager plain | x default plain | steps/token (model) "
          "| ms/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in res["c1"]:
        print(f"| {r['scale']} | {r['mode']} | {r['k']} | {r['d']} | {r['acceptance']:.3f} | "
              f"{r['decode_tokens_per_s']:.1f} | {r['speedup_vs_eager']:.2f} | {r['speedup_vs_default']:.2f} | "
              f"{r['steps_per_token']:.2f} ({r['model_steps_per_token']:.2f}) | {r['ms_per_step']:.2f} |")
    spec = sorted(r["ms_per_step"] for r in res["c1"] if not r["mode"].startswith("adaptive"))
    if spec:
        mid = spec[len(spec) // 2]
        print("a speculative step costs (median ms/step over the C=1 runs, --self-spec-step-cost): " + ", ".join(
            f"{mid / v['ms_per_step']:.2f} {k} steps" for k, v in b.items()))
    if res.get("skipped_scales"):
        print(f"skipped (deadline): scales {res['skipped_scales']}")
    for r in res["big_c"]:
        print(f"C={r['c']} {r['run']} (max_running {r['max_running']}): {r['decode_tokens_per_s']:.1f} tok/s "
              f"x{r['speedup_vs_plain']:.2f} vs plain, acceptance {r['acceptance']:.3f}")
    print(f"total {res['seconds']:.0f} s")


if __name__ == "__main__":
    main()
