"""Benchmark report: environment versions, the results table with roofline ratios, targets.

``environment()`` records device, driver, torch / CUDA / Triton / Python versions and the rlt
package versions and commit. ``markdown(results)`` renders one table row per workload and baseline:
each number is followed by its floor and ``×k`` = measured time / floor time (1.0× is the
roofline; larger is slower). This module formats; it measures nothing.
"""

from __future__ import annotations

import os
import platform as _platform
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

#: Targets from issue 5 (Ouro-1.4B bf16 on one H200), keyed by workload shape (C, in, out).
TARGETS = {
    (1, 1024, 128): ("decode_tok_s", 300.0, "C=1 decode >= 300 tok/s"),
    (64, 1024, 128): ("decode_tok_s", 3800.0, "C=64 1K decode >= 3,800 tok/s"),
    (128, 1024, 128): ("e2e_tok_s", 2500.0, "C=128 1K/128 end-to-end >= 2,500 tok/s"),
    (1, 8192, 1): ("prefill_tok_s", 40000.0, "single 8K prefill >= 40,000 tok/s"),
}


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _pkg_version(pyproject: Path) -> str | None:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        return None
    try:
        return tomllib.loads(pyproject.read_text())["project"]["version"]
    except (OSError, KeyError, ValueError):
        return None


def source_fingerprint() -> str:
    """sha256 over the Python sources that run (packages, apps, benchmarks), path and content.

    Works where the tree was copied without ``.git`` (a device machine): recompute it on a
    checkout to tell which source a result came from.
    """
    import hashlib

    h = hashlib.sha256()
    files = sorted(p for pat in ("packages/*/src/**/*.py", "apps/*/src/**/*.py", "benchmarks/*.py")
                   for p in REPO.glob(pat))
    for p in files:
        h.update(str(p.relative_to(REPO)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def environment(device: torch.device) -> dict:
    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "host": _platform.node(),
        "cpu": _platform.processor() or _platform.machine(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001 - report why, whatever it is
        env["triton"] = f"not importable ({type(exc).__name__})"
    if device.type == "cuda":
        env["device"] = torch.cuda.get_device_name(device)
        props = torch.cuda.get_device_properties(device)
        env["device_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["sm_count"] = props.multi_processor_count
        env["capability"] = f"sm{props.major}{props.minor}"
        smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        env["driver"] = smi.splitlines()[0] if smi else None
    else:
        env["device"] = f"cpu ({env['cpu']}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"
        env["driver"] = None
    env["rlt_packages"] = {p.parent.name: _pkg_version(p) for p in sorted(REPO.glob("packages/*/pyproject.toml"))}
    env["rlt_commit"] = os.environ.get("RLT_GIT_COMMIT") or _run(["git", "rev-parse", "--short=12", "HEAD"])
    env["rlt_source_sha256"] = source_fingerprint()
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    env["rlt_dirty"] = bool(dirty) if env["rlt_commit"] and not os.environ.get("RLT_GIT_COMMIT") else None
    return env


def _n(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def _rate(measured, floor) -> str:
    """A throughput with its floor and the time ratio floor/measured."""
    if measured is None:
        return "-"
    if not floor:
        return _n(measured)
    return f"{_n(measured)} ({_n(floor)}; {floor / measured:.1f}×)"


def _time(measured, floor) -> str:
    if measured is None:
        return "-"
    if not floor:
        return _n(measured, 2)
    return f"{_n(measured, 2)} ({_n(floor, 2)}; {measured / floor:.1f}×)"


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.1f}"


def table(rows: list[dict]) -> list[str]:
    head = ("| workload | path | C | in/out | req | e2e tok/s | decode tok/s | ms/token step | ms/loop step | "
            "TTFT p50 / p95 ms | TPOT p50 / p95 ms | prefill tok/s | peak GiB | depth | reps |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        wl, med, fl = r["workload"], r.get("median") or {}, r.get("floor") or {}
        if r.get("error"):
            lines.append(f"| {wl['name']} | {r.get('backend', '-')} | {wl['concurrency']} | "
                         f"{wl['prompt_len']}/{wl['output_len']} | {wl.get('requests', '-')} | "
                         f"failed: {r['error'][:120]} |" + " |" * 10)
            continue
        out_run = r.get("output_len_run", wl["output_len"])
        io = f"{wl['prompt_len']}/{out_run}" + ("" if out_run == wl["output_len"] else f" (of {wl['output_len']})")
        ttft = med.get("ttft_ms_p50", med.get("ttft_ms"))
        ttft95 = med.get("ttft_ms_p95")
        tpot = med.get("tpot_ms_p50", med.get("ms_per_token_step") if r.get("kind") else None)
        tpot95 = med.get("tpot_ms_p95")
        ttft_floor = 1e3 * fl["prefill_s"] if fl.get("prefill_s") else None
        step_floor = 1e3 * fl["decode_step_s"] if fl.get("decode_step_s") else None
        prefill_floor = wl["prompt_len"] / fl["prefill_s"] if fl.get("prefill_s") else None
        path = r.get("backend") if not r.get("kind") else f"baseline: {r['kind']}"
        lines.append(" | ".join([
            f"| {wl['name']}", path or "-", str(wl["concurrency"]), io, str(wl.get("requests", "-")),
            _rate(med.get("e2e_tok_s"), fl.get("e2e_tok_s")),
            _rate(med.get("decode_tok_s"), fl.get("decode_tok_s")),
            _time(med.get("ms_per_token_step"), step_floor),
            _n(med.get("ms_per_loop_step"), 2),
            f"{_time(ttft, ttft_floor)} / {_n(ttft95)}",
            f"{_time(tpot, step_floor)} / {_n(tpot95, 2)}",
            _rate(med.get("prefill_tok_s"), prefill_floor) if med.get("prefill_tok_s") else "-",
            _gib(r.get("peak_memory_bytes")),
            _n(med.get("mean_exit_depth"), 2),
            f"{r.get('reps_run', '-')} |",
        ]))
    return lines


def markdown(results: dict) -> str:
    env, ceil = results["environment"], results.get("ceilings") or {}
    model = results["model"]
    lines = [f"# rlt offline benchmark — {model['name']}", ""]
    if model.get("random_weights"):
        lines += [f"> Model: **{model['name']}** shapes with **random weights** (seed {model.get('seed')}): "
                  "they keep the shapes, bytes and FLOPs of the real model, not its text quality "
                  "(and adaptive-depth exit statistics come from a random gate).", ""]
    lines += [
        f"- device: {env.get('device')} · driver {env.get('driver') or '-'} · torch {env.get('torch')} "
        f"(CUDA {env.get('cuda_runtime') or '-'}) · Triton {env.get('triton')} · Python {env.get('python')}",
        f"- rlt: {', '.join(f'{k} {v}' for k, v in env.get('rlt_packages', {}).items())} · commit "
        f"{env.get('rlt_commit') or '-'}{' (dirty)' if env.get('rlt_dirty') else ''} · source sha256 "
        f"{env.get('rlt_source_sha256')} (`python -c 'from benchmarks.report import source_fingerprint as f; print(f())'`)",
        f"- dtype {model.get('dtype')} · attention backend requested `{results['options'].get('attention_backend')}`"
        + (f" · {results['backend_note']}" if results.get("backend_note") else ""),
        f"- measured ceilings (this run): copy {ceil.get('copy_bytes_per_s', 0) / 1e12:.2f} TB/s (read+write), "
        f"{ceil.get('dtype')} matmul {ceil.get('matmul_flops_per_s', 0) / 1e12:.1f} TFLOP/s "
        f"({ceil.get('matmul_n')}³)",
        f"- command: `{results.get('command')}`",
        "",
        "Each cell: measured (floor; ×k) where ×k = measured time / floor time. Floors are "
        "max(bytes / copy bandwidth, FLOPs / matmul rate) from `benchmarks/roofline.py`; the TTFT floor is one "
        "prompt's prefill, the TPOT and token-step floor one decode step of all C rows. One warm-up "
        "discarded, median of the measured repetitions (`reps`).",
        "",
    ]
    rows = list(results["workloads"]) + list(results.get("baselines", []))
    lines += table(rows)
    lines.append("")
    notes = [(r["workload"]["name"], n) for r in rows for n in r.get("notes", [])]
    if notes:
        lines += ["Notes:", ""] + [f"- {name}: {n}" for name, n in notes] + [""]
    tgt = target_lines(results)
    if tgt:
        lines += ["## Against the issue's targets", "", "| target | measured | gap | floor |", "|---|---|---|---|"]
        lines += tgt + [""]
    lines += ["## Roofline terms per workload", "",
              "| workload | decode step bytes | decode step FLOPs | decode bound | decode step floor ms | "
              "prefill floor ms (one prompt) | prefill bound | e2e floor s |", "|---|---|---|---|---|---|---|---|"]
    for r in results["workloads"]:
        fl = r.get("floor")
        if not fl:
            continue
        lines.append(f"| {r['workload']['name']} | {fl['decode_step_bytes'] / 1e9:.2f} GB | "
                     f"{fl['decode_step_flops'] / 1e9:.1f} GFLOP | {fl['decode_bound']} | {1e3 * fl['decode_step_s']:.2f} | "
                     f"{1e3 * fl['prefill_s']:.1f} | {fl['prefill_bound']} | {fl['e2e_s']:.2f} |")
    lines.append("")
    return "\n".join(lines)


def target_lines(results: dict) -> list[str]:
    if results["model"]["name"] != "ouro-1.4b":
        return []
    out = []
    for r in results["workloads"]:
        wl = r["workload"]
        key = (wl["concurrency"], wl["prompt_len"], wl["output_len"])
        if key not in TARGETS or r.get("error") or wl.get("exit_threshold", 1.0) < 1.0:
            continue
        metric, goal, label = TARGETS[key]
        got = (r.get("median") or {}).get(metric)
        fl = r.get("floor") or {}
        floor = {"decode_tok_s": fl.get("decode_tok_s"), "e2e_tok_s": fl.get("e2e_tok_s"),
                 "prefill_tok_s": wl["prompt_len"] / fl["prefill_s"] if fl.get("prefill_s") else None}[metric]
        gap = f"{goal / got:.1f}× below" if got and got < goal else ("met" if got else "-")
        out.append(f"| {label} | {_n(got)} tok/s ({r.get('backend')}) | {gap} | {_n(floor)} tok/s |")
    return out
