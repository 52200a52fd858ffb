"""Where an overlapped chain step's time goes (issue 13): plain decoding and a d-loop chain, one
request each, timed and then profiled (torch profiler) over the same number of engine steps.

A chain step at C = 1 cost 1.06x a plain one on the H100 (lease 12: 1.54 against 1.45 ms); an LM
head of two rows every other step explains part of it. This tells the rest: per engine step, the
host wall time (no sync inside the window: the pipeline runs as it does when serving), the device
busy time (union of kernel intervals) and idle share, kernel launches and aten ops, and the
kernels side by side (plain us/step, chain us/step), so the difference has names.

    python -m benchmarks.spec_profile --preset h200 --scales 0.002 --ks 8 --ds 2 --out-dir "$OUT/specprof"
    python -m benchmarks.spec_profile --preset cpu --out-dir /tmp/specprof    # the logic, on CPU

Options are spec_bench's (the first of ``--scales``, ``--ks`` and ``--ds`` is used) plus ``--steps``
(engine steps per window) and ``--warm-steps``. Writes ``spec_profile.json`` and ``spec_profile.md``.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_model import write_random_checkpoint
from benchmarks.profile_step import step_profile
from benchmarks.spec_bench import Bench, ScaledLoader, _floats, _ints, decode_features, log, parse_args
from rlt.platform import SamplingParams
from rlt.platform.platforms import detect_platform


def _steps(engine, n: int, rid: str) -> int:
    """Run ``n`` engine steps; the request's token count after them (it must not finish inside)."""
    count = 0
    for _ in range(n):
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"the request finished inside the window: raise --out above {n} steps' tokens")
        for o in engine.step():
            if o.request_id == rid:
                count = len(o.token_ids)
    return count


def window(engine, spec, *, prompt: list[int], out: int, steps: int, warm_steps: int) -> dict:
    """One request decoding with ``spec`` (None: plain): past its first token and ``warm_steps``
    more steps, a timed window of ``steps`` engine steps, then a profiled one of as many."""
    cuda = engine.device.type == "cuda"
    sync = engine.ctx.platform.synchronize
    rid = f"prof-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True,
                                                   speculation=spec))
    try:
        tokens = 0
        while tokens == 0:
            tokens = _steps(engine, 1, rid) or tokens
        tokens = _steps(engine, warm_steps, rid) or tokens
        sync()
        t0 = time.perf_counter()
        timed = _steps(engine, steps, rid) or tokens
        sync()
        wall = time.perf_counter() - t0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            t1 = time.perf_counter()
            _steps(engine, steps, rid)
            sync()
            profiled_ms = 1e3 * (time.perf_counter() - t1) / steps
    finally:
        engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    return {"ms_per_step": 1e3 * wall / steps, "tokens_per_step": (timed - tokens) / steps,
            "ms_per_token": 1e3 * wall / max(timed - tokens, 1), "steps": steps,
            **step_profile(prof, steps, profiled_ms, cuda, top=40)}


def _cell(v) -> str:
    """A (calls, us) pair as "us (calls)", or "-"."""
    return "-" if v is None else f"{v[1]:.1f} ({v[0]:.2f})"


def markdown(res: dict) -> str:
    a = res["args"]
    p, c = res["plain"], res["chain"]
    lines = [f"# Chain step profile: K = {res['k']}, d = {res['d']}, scale {res['scale']} ({a['model']}, {a['dtype']}, "
             f"{a['device']}, {p['steps']} engine steps per window)", "",
             "| per engine step | plain | chain |", "| --- | --- | --- |"]
    rows = [("wall, timed window (ms)", "ms_per_step", "{:.3f}"), ("tokens per step", "tokens_per_step", "{:.3f}"),
            ("wall per token (ms)", "ms_per_token", "{:.3f}"), ("wall under the profiler (ms)", "host_wall_ms_per_step", "{:.3f}"),
            ("device busy (ms)", "device_busy_ms_per_step", "{:.3f}"), ("device kernel time (ms)", "device_kernel_ms_per_step", "{:.3f}"),
            ("device idle share", "device_idle_fraction", "{:.1%}"), ("kernel launches", "kernel_launches_per_step", "{:.1f}"),
            ("device kernels", "device_kernels_per_step", "{:.1f}"), ("aten ops", "aten_ops_per_step", "{:.1f}")]
    for label, key, fmt in rows:
        cells = ["-" if r[key] is None else fmt.format(r[key]) for r in (p, c)]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    for title, field, unit in (("Kernels", "top_kernels", "us_per_step"), ("Host ops (self CPU)", "top_host_ops",
                                                                           "self_cpu_us_per_step")):
        names = {k["name"]: [None, None] for r in (p, c) for k in r[field]}
        for i, r in enumerate((p, c)):
            for k in r[field]:
                names[k["name"]][i] = (k["calls_per_step"], k[unit])
        if not names:
            continue
        lines += ["", f"{title}, per engine step (us; calls):", "", "| name | plain | chain | chain - plain |",
                  "| --- | --- | --- | --- |"]
        order = sorted(names.items(), key=lambda kv: -max((v[1] for v in kv[1] if v), default=0))
        for name, (pv, cv) in order:
            diff = (cv[1] if cv else 0.0) - (pv[1] if pv else 0.0)
            lines.append(f"| `{name[:90]}` | {_cell(pv)} | {_cell(cv)} | {diff:+.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    def extra(ap):
        ap.add_argument("--steps", type=int, default=64, help="engine steps per window (timed, then profiled)")
        ap.add_argument("--warm-steps", type=int, default=24)
        ap.add_argument("--width", type=int, default=1, help="--self-spec-width of the chain (wide chains: docs/spec.md)")
    args = parse_args(argv, prog="python -m benchmarks.spec_profile", description=__doc__, extra=extra)
    scale, k, d = _floats(args.scales)[0], _ints(args.ks)[0], _ints(args.ds)[0]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="spec-profile-"))
    src = write_random_checkpoint(work / "src", args.model)
    bench = Bench(args, src, ScaledLoader(), decode_features(), detect_platform(args.device))
    engine = bench.engine(scale, overlap=True, options={"width": args.width})
    bench.warm(engine, 1, {"num_tokens": k, "draft_loops": d})
    rng = random.Random(0)
    prompt = [rng.randrange(3, min(engine.model.shape.vocab_size, 30000)) for _ in range(args.input_len)]
    res = {"args": vars(args), "scale": scale, "k": k, "d": d, "width": args.width,
           "components": engine.assembly.describe(), "device_name": torch.cuda.get_device_name(0)
           if args.device == "cuda" else "cpu"}
    for name, spec in (("plain", {"num_tokens": 0}), ("chain", {"num_tokens": k, "draft_loops": d})):
        res[name] = window(engine, spec, prompt=prompt, out=args.out, steps=args.steps, warm_steps=args.warm_steps)
        log(f"{name}: {res[name]['ms_per_step']:.3f} ms/step, {res[name]['ms_per_token']:.3f} ms/token")
    (out_dir / "spec_profile.json").write_text(json.dumps(res, indent=1, default=str))
    text = markdown(res)
    (out_dir / "spec_profile.md").write_text(text)
    print(text)
    return res


if __name__ == "__main__":
    main()
