"""rlt offline benchmark: closed-loop workloads, roofline ratios, baselines, decode-step profiles.

One command on CPU (tiny model, seconds)::

    PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:. \\
        python -m benchmarks.offline_bench --preset cpu-tiny --out-dir /tmp/rlt-bench

and on a GPU with real shapes (what ``scripts/bench_h200.sh`` runs)::

    python -m benchmarks.offline_bench --model ouro-1.4b --dtype bfloat16 \\
        --workload c=1,in=1024,out=128 --workload c=64,in=1024,out=128 ... \\
        --baseline dense:c=1,in=1024,out=32 --profile c=64,in=1024 --out-dir $OUT

``--model`` is a checkpoint directory or a named configuration (``ouro-1.4b``, ``ouro-2.6b``,
``ouro-tiny``) written with random weights on the fly (same shapes and costs, no text quality).
Writes ``results.json`` and ``results.md`` (and ``profile.json`` / ``profile_summary.md`` when
profiling) into ``--out-dir``, and prints the table. Workload fields: ``c`` concurrency, ``in``
prompt tokens, ``out`` output tokens, ``req`` requests (default 2·c, closed loop), ``tau`` exit
threshold (< 1 = adaptive depth), ``min_loops``, ``max_loops``, ``budget`` seconds (time cap: fewer
repetitions, then fewer output tokens, each cut recorded), ``name``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path

import attrs
import torch

from benchmarks import baseline as baselines
from benchmarks.bench_model import NAMED_CONFIGS, bench_shape, write_random_checkpoint
from benchmarks.profile_step import profile_decode, summary_markdown
from benchmarks.report import environment, markdown
from benchmarks.roofline import ModelCost, measure_ceilings, workload_floor
from benchmarks.workload import CheckpointCache, EngineOptions, Workload, run_workload
from rlt.attention import KVLayout
from rlt.platform.attention_select import build_attention, select_attention
from rlt.platform.checkpoint.loader import read_config, resolve_dtype
from rlt.platform.platforms import detect_platform

PRESETS = {
    "cpu-tiny": dict(
        model="ouro-tiny",
        workloads=["c=1,in=32,out=8,req=2", "c=4,in=32,out=8", "c=4,in=64,out=8,req=4,tau=0.6,name=c4-adaptive"],
        baselines=["reference:c=1,in=32,out=4", "dense:c=4,in=32,out=8"],
        profiles=["c=2,in=32"],
    ),
}


def log(msg: str) -> None:
    print(msg, flush=True)


def _split_budget(spec: str) -> tuple[str, float | None]:
    parts, budget = [], None
    for p in spec.split(","):
        if p.strip().startswith("budget="):
            budget = float(p.split("=", 1)[1])
        else:
            parts.append(p)
    return ",".join(parts), budget


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.offline_bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a ready-made set of workloads (cpu-tiny)")
    ap.add_argument("--model", help=f"checkpoint directory or one of {', '.join(NAMED_CONFIGS)} (random weights)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="auto (the checkpoint's) | bfloat16 | float16 | float32")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--fallback-backend", default="torch",
                    help="backend to use when the requested one cannot be built or fails in a workload ('' = none)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--feature-module", action="append", default=[], metavar="MODULE",
                    help="compose the FEATURES of this module into the engine (repeatable), e.g. rlt.decode.feature; "
                         "default: the base engine")
    ap.add_argument("--disable-feature", action="append", default=[], metavar="NAME",
                    help="switch off one feature of the composed modules (repeatable), e.g. pipeline")
    ap.add_argument("--feature-flag", action="append", default=[], metavar="FLAG",
                    help="an option flag of a composed feature as rlt-server serve takes it, e.g. "
                         "--feature-flag=--pipeline-device-exit (repeatable)")
    ap.add_argument("--fixed-depth", action="store_true",
                    help="serve fixed depth (EngineConfig.fixed_depth): lets auto pick FlashAttention for LAST_EXITED; "
                         "adaptive (tau<1) workloads are refused")
    ap.add_argument("--workload", action="append", default=[], help="c=,in=,out=[,req=,tau=,budget=,name=]")
    ap.add_argument("--baseline", action="append", default=[], help="reference:SPEC or dense:SPEC")
    ap.add_argument("--profile", action="append", default=[], help="c=,in= : profile decode steps at C rows")
    ap.add_argument("--reps", type=int, default=3, help="measured repetitions (median reported)")
    ap.add_argument("--warmup-output-len", type=int, default=4)
    ap.add_argument("--no-sync-steps", action="store_true", help="do not synchronise the device after each step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gate-bias", type=float, default=0.0, help="exit-gate bias of random-weight models")
    ap.add_argument("--work-dir", help="where random-weight checkpoints are written (default: a temp dir)")
    ap.add_argument("--out-dir", default="benchmarks/results/latest")
    args = ap.parse_args(argv)
    if args.preset:
        p = PRESETS[args.preset]
        args.model = args.model or p["model"]
        args.workload = args.workload or list(p["workloads"])
        args.baseline = args.baseline or list(p["baselines"])
        args.profile = args.profile or list(p["profiles"])
    if not args.model:
        ap.error("give --model DIR|NAME or --preset")
    if not (args.workload or args.baseline or args.profile):
        ap.error("nothing to run: give --workload, --baseline or --profile")
    return args


def resolve_model(args, device: torch.device) -> tuple[str, dict]:
    if os.path.isdir(args.model):
        return args.model, {"name": Path(args.model).name, "path": args.model, "random_weights": False}
    if args.model not in NAMED_CONFIGS:
        raise SystemExit(f"--model {args.model!r} is neither a directory nor one of {', '.join(NAMED_CONFIGS)}")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="rlt-bench-"))
    path = work / f"{args.model}-random-seed{args.seed}"
    if not (path / "config.json").is_file():
        t = time.perf_counter()
        write_random_checkpoint(path, args.model, seed=args.seed, gate_bias=args.gate_bias, device=device)
        log(f"wrote random-weight {args.model} checkpoint to {path} in {time.perf_counter() - t:.1f} s")
    return str(path), {"name": args.model, "path": str(path), "random_weights": True, "seed": args.seed,
                       "gate_bias": args.gate_bias}


def choose_backend(args, platform, dtype, head_dim) -> tuple[str, str | None]:
    """The backend name to pass to the engine, and a note if it had to fall back."""
    try:
        sel = select_attention(platform, args.attention_backend, dtype=dtype, head_dim=head_dim,
                               block_size=args.block_size, kv_layout=KVLayout.LAST_EXITED,
                               adaptive_exit=not args.fixed_depth)
        build_attention(platform, sel)
        if args.attention_backend == sel.name:
            return sel.name, None
        skipped = "; ".join(f"{n}: {why}" for n, why in sel.skipped)
        return sel.name, f"auto selected `{sel.name}` ({sel.reason}{'; skipped ' + skipped if skipped else ''})"
    except Exception as exc:  # noqa: BLE001 - any failure to build is reported and, if allowed, falls back
        if not args.fallback_backend or args.fallback_backend == args.attention_backend:
            raise
        return args.fallback_backend, (f"backend `{args.attention_backend}` unusable "
                                       f"({type(exc).__name__}: {str(exc)[:200]}); fell back to `{args.fallback_backend}`")


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_all = time.perf_counter()
    platform = detect_platform(args.device)
    device = platform.device()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log(f"rlt offline benchmark on {platform.name} ({device})")
    model_dir, model_info = resolve_model(args, device)
    _, _raw, family, parsed = read_config(model_dir)
    model_cfg = bench_shape(family.model_type, parsed)
    dtype = resolve_dtype(args.dtype, getattr(model_cfg, "torch_dtype", None))
    model_info["dtype"] = str(dtype).removeprefix("torch.")
    elem = torch.empty((), dtype=dtype).element_size()
    cost = ModelCost.from_config(model_cfg, elem)

    env = environment(device)
    log(f"device {env['device']} · driver {env.get('driver')} · torch {env['torch']} · triton {env['triton']}")
    ceilings = measure_ceilings(device, dtype)
    log(f"ceilings: copy {ceilings.copy_bytes_per_s / 1e12:.2f} TB/s, {ceilings.dtype} matmul "
        f"{ceilings.matmul_flops_per_s / 1e12:.1f} TFLOP/s")
    backend, backend_note = choose_backend(args, platform, dtype, model_cfg.head_dim)
    log(f"attention backend: {backend}" + (f" ({backend_note})" if backend_note else ""))
    opts = EngineOptions(device=args.device, dtype=args.dtype, attention_backend=backend,
                         block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                         fixed_depth=args.fixed_depth, feature_modules=tuple(args.feature_module),
                         disabled_features=tuple(args.disable_feature), feature_flags=tuple(args.feature_flag))
    results = {
        "schema": "rlt-offline-bench/1",
        "command": " ".join(shlex.quote(a) for a in ([Path(sys.argv[0]).name] if argv is None else ["offline_bench"])
                            + (sys.argv[1:] if argv is None else list(argv))),
        "environment": env, "model": model_info, "ceilings": ceilings.to_dict(),
        "options": {"attention_backend": args.attention_backend, "backend_used": backend,
                    "block_size": args.block_size, "max_num_batched_tokens": args.max_num_batched_tokens,
                    "fixed_depth": args.fixed_depth, "feature_modules": args.feature_module,
                    "disabled_features": args.disable_feature, "feature_flags": args.feature_flag, "reps": args.reps, "warmup_output_len": args.warmup_output_len,
                    "sync_steps": not args.no_sync_steps},
        "backend_note": backend_note,
        "workloads": [], "baselines": [], "profiles": [],
    }
    cache = CheckpointCache()
    # one checkpoint cache for every engine of this run (LLMEngine(load_checkpoint=cache.load))
    for spec in args.workload:
        base_spec, budget = _split_budget(spec)
        wl = Workload.parse(base_spec)
        log(f"workload {wl.describe()}" + (f" (budget {budget:.0f} s)" if budget else ""))
        results["workloads"].append(_run_one(args, model_dir, model_cfg, cost, ceilings, wl, opts, budget,
                                               cache.load))
        _write(out_dir, results)
    if args.baseline:
        ckpt = cache.load(model_dir, dtype=dtype, device=device)
        for spec in args.baseline:
            kind, _, rest = spec.partition(":")
            wl = Workload.parse(rest + (f",name=baseline-{kind}" if "name=" not in rest else ""))
            log(f"baseline {kind}: {wl.describe()}")
            results["baselines"].append(_run_baseline(kind, ckpt, wl, device, args, cost, ceilings))
            _write(out_dir, results)
        del ckpt
    for spec in args.profile:
        fields = dict(p.split("=", 1) for p in spec.split(",") if p)
        c, p_len = int(fields["c"]), int(fields["in"])
        log(f"profile: decode steps at C={c}, context {p_len}")
        try:
            prof = profile_decode(model_dir, model_cfg, concurrency=c, prompt_len=p_len, opts=opts,
                                  backend=backend, seed=args.seed)
            log(f"  {prof['host_wall_ms_per_step']:.2f} ms/step host wall, "
                f"{prof['kernel_launches_per_step'] or prof['aten_ops_per_step']:.0f} launches (ops)/step")
        except Exception as exc:  # noqa: BLE001
            log(f"  profile failed: {type(exc).__name__}: {exc}")
            prof = {"concurrency": c, "prompt_len": p_len, "error": f"{type(exc).__name__}: {exc}"}
        results["profiles"].append(prof)
    cache.clear()
    results["elapsed_s"] = time.perf_counter() - t_all
    _write(out_dir, results)
    md = markdown(results)
    log("")
    log(md)
    ok_profiles = [p for p in results["profiles"] if "error" not in p]
    if ok_profiles:
        summary = summary_markdown(ok_profiles)
        (out_dir / "profile_summary.md").write_text(summary + "\n")
        log(summary)
    log(f"total {results['elapsed_s']:.0f} s; results in {out_dir}")
    return results


def _run_one(args, model_dir, model_cfg, cost, ceilings, wl, opts, budget, load_checkpoint=None) -> dict:
    loops = model_cfg.total_ut_steps if not wl.adaptive else None
    try:
        try:
            res = run_workload(model_dir, model_cfg, attrs.evolve(wl), opts, backend=opts.attention_backend,
                               reps=args.reps, warmup_output_len=args.warmup_output_len, budget_s=budget,
                               seed=args.seed, sync_steps=not args.no_sync_steps, progress=log,
                               load_checkpoint=load_checkpoint)
        except Exception as exc:  # noqa: BLE001
            fb = args.fallback_backend
            if not fb or fb == opts.attention_backend or "OutOfMemoryError" in f"{type(exc).__name__}{exc}":
                raise
            log(f"  {opts.attention_backend} failed ({type(exc).__name__}: {str(exc)[:300]}); retrying with {fb}")
            res = run_workload(model_dir, model_cfg, wl, attrs.evolve(opts, attention_backend=fb), backend=fb,
                               reps=args.reps, warmup_output_len=args.warmup_output_len, budget_s=budget,
                               seed=args.seed, sync_steps=not args.no_sync_steps, progress=log,
                               load_checkpoint=load_checkpoint)
            res["notes"].append(f"{opts.attention_backend} failed ({type(exc).__name__}: {str(exc)[:200]}); ran {fb}")
    except Exception as exc:  # noqa: BLE001 - a failed workload is reported, the run goes on
        log(f"  FAILED: {type(exc).__name__}: {exc}")
        traceback.print_exc()
        return {"workload": attrs.asdict(wl) | {"requests": wl.requests}, "backend": opts.attention_backend,
                "error": f"{type(exc).__name__}: {exc}", "notes": []}
    ran = res["workload"]
    depth = res["median"].get("mean_exit_depth") or loops or model_cfg.total_ut_steps
    floor = workload_floor(cost, ceilings, concurrency=ran["concurrency"], prompt_len=ran["prompt_len"],
                           output_len=res["output_len_run"], num_requests=ran["requests"], loops=depth)
    res["floor"] = floor.to_dict()
    m = res["median"]
    log(f"  median: e2e {_f(m['e2e_tok_s'])} tok/s (floor {_f(floor.e2e_tok_s)}), decode {_f(m['decode_tok_s'])} tok/s "
        f"(floor {_f(floor.decode_tok_s)}), token step {_f(m['ms_per_token_step'])} ms "
        f"(floor {1e3 * floor.decode_step_s:.2f}), TTFT p50 {_f(m['ttft_ms_p50'])} ms, "
        f"peak {(res['peak_memory_bytes'] or 0) / 2**30:.1f} GiB, {res['elapsed_s']:.0f} s")
    return res


def _run_baseline(kind, ckpt, wl, device, args, cost, ceilings) -> dict:
    runner = {"reference": baselines.run_reference, "dense": baselines.run_dense}.get(kind)
    if runner is None:
        raise SystemExit(f"unknown baseline {kind!r}; choose reference or dense")
    try:
        res = runner(ckpt, wl, device, reps=args.reps, seed=args.seed)
    except Exception as exc:  # noqa: BLE001
        log(f"  FAILED: {type(exc).__name__}: {exc}")
        traceback.print_exc()
        return {"kind": kind, "workload": attrs.asdict(wl) | {"requests": wl.concurrency},
                "error": f"{type(exc).__name__}: {exc}", "notes": []}
    ran = res["workload"]
    floor = workload_floor(cost, ceilings, concurrency=ran["concurrency"], prompt_len=ran["prompt_len"],
                           output_len=ran["output_len"], num_requests=ran["requests"],
                           loops=res["median"].get("mean_exit_depth") or cost.num_loops)
    res["floor"] = floor.to_dict()
    m = res["median"]
    log(f"  median: e2e {_f(m['e2e_tok_s'])} tok/s, decode {_f(m['decode_tok_s'])} tok/s, "
        f"token step {_f(m['ms_per_token_step'])} ms, TTFT {_f(m['ttft_ms'])} ms")
    return res


def _f(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _write(out_dir: Path, results: dict) -> None:
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out_dir / "results.md").write_text(markdown(results) + "\n")
    if results.get("profiles"):
        (out_dir / "profile.json").write_text(json.dumps(results["profiles"], indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
