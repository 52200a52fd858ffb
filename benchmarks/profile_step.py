"""Torch-profiler view of steady-state decode steps: where one engine step's time goes.

For a decode batch of C rows at a given context, the engine is brought to steady state (every
row past its prompt, rows spread over depths), a few steps are run untimed, then ``steps`` engine
steps (one loop each for every row; ``steps = loops`` covers one token per row) are profiled
with CPU and device activities. Reported per engine step:

* host wall time (``step()`` plus a device synchronise) and the device time (kernel durations
  summed, and the union of their intervals = the time the device was busy);
* kernel launches (runtime launch calls seen on the host) and device kernels executed;
* the largest kernels by device time, and the largest host-side ops by self CPU time.

On a CPU-only run the "device" columns are empty and launches count aten ops instead.
This module only observes; it does not change how the engine runs.
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.observe import REGION_ORDER, StepRecorder, timed_assembly
from benchmarks.workload import EngineOptions, Workload, prompts_for
from rlt.platform.platforms import detect_platform
from rlt.platform.sampling_params import SamplingParams

_LAUNCH_NAMES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                 "cudaMemcpyAsync", "cudaMemsetAsync", "hipLaunchKernel", "hipExtModuleLaunchKernel")


def _is_device_event(ev) -> bool:
    dt = getattr(ev, "device_type", None)
    return dt is not None and str(dt).endswith(("CUDA", "PrivateUse1", "HIP"))


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def profile_decode(model_dir: str, model_cfg, *, concurrency: int, prompt_len: int, opts: EngineOptions,
                   backend: str, steps: int | None = None, warm_steps: int = 8, seed: int = 0,
                   top: int = 15, load_checkpoint=None) -> dict:
    loops = model_cfg.total_ut_steps
    steps = steps or loops
    wl = Workload(name=f"profile-c{concurrency}", concurrency=concurrency, prompt_len=prompt_len,
                  output_len=warm_steps + steps + 2 * loops + 2, num_requests=concurrency)
    cfg = opts.engine_config(model_dir, wl, backend=backend, num_loops=loops)
    # the features of opts (e.g. rlt-decode's static path, with graphs disabled so kernels are seen)
    assembly, regions = timed_assembly(detect_platform(cfg.device),
                                       opts.plan(cfg).assembly if opts.feature_modules else None)
    engine = assembly.build_engine(cfg, load_checkpoint=load_checkpoint)
    recorder = StepRecorder()
    engine.add_observer(recorder)
    device = engine.device
    cuda = device.type == "cuda"
    try:
        params = SamplingParams(max_tokens=wl.output_len, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts_for(wl, model_cfg.vocab_size, seed, concurrency)):
            engine.add_request(f"prof-{i}", p, params)
        # Until every row is past its prompt, then a few steady-state steps.
        guard = 0
        while engine.stats().num_waiting or not recorder.prefill or recorder.last_had_prompt_rows:
            engine.step()
            guard += 1
            if guard > 64 * loops:
                raise RuntimeError("profiler warm-up did not reach pure decode")
        for _ in range(warm_steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize(device)
        # Unprofiled steps first: clean host wall times and where the host spends them.
        plain = []
        regions.clear()
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            if cuda:
                torch.cuda.synchronize(device)
            plain.append(time.perf_counter() - t)
        plain_ms = 1e3 * sum(plain) / steps
        region_ms = {k: 1e3 * regions[k] / steps for k in REGION_ORDER if k in regions}
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        walls = []
        rows = engine.stats().num_running
        with profile(activities=activities) as prof:
            for _ in range(steps):
                t = time.perf_counter()
                engine.step()
                if cuda:
                    torch.cuda.synchronize(device)
                walls.append(time.perf_counter() - t)
        return {
            "concurrency": concurrency, "prompt_len": prompt_len, "backend": engine.selection.name,
            "rows": rows, "steps_profiled": steps, "loops_per_token": loops,
            "unprofiled_wall_ms_per_step": plain_ms,
            "host_regions_ms_per_step": region_ms,
            **step_profile(prof, steps, 1e3 * sum(walls) / steps, cuda, top),
        }
    finally:
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def step_profile(prof, steps: int, wall_ms: float, cuda: bool, top: int = 15) -> dict:
    """Per-step figures of a finished ``torch.profiler.profile`` over ``steps`` engine steps that took
    ``wall_ms`` each on the host: device busy (union of kernel intervals) and kernel time, idle share,
    launches, kernels and aten ops per step, the largest kernels and host ops. Device figures are None
    without a device (``cuda`` False)."""
    events = prof.events()
    kernels = [e for e in events if _is_device_event(e)]
    launches = sum(1 for e in events if e.name in _LAUNCH_NAMES)
    aten_ops = sum(1 for e in events if e.name.startswith("aten::") and not _is_device_event(e))
    by_kernel: dict[str, list[float]] = defaultdict(list)
    intervals = []
    for e in kernels:
        dur = e.time_range.end - e.time_range.start
        by_kernel[e.name].append(dur)
        intervals.append((e.time_range.start, e.time_range.end))
    kernel_us = sum(sum(v) for v in by_kernel.values())
    if cuda and not kernels:  # this torch lists no device events: fall back to the op averages
        for avg in prof.key_averages():
            dev = getattr(avg, "self_device_time_total", None) or getattr(avg, "self_cuda_time_total", 0)
            if dev and not avg.key.startswith(("aten::", "cuda")):
                by_kernel[avg.key] = [dev / max(avg.count, 1)] * avg.count
        kernel_us = sum(sum(v) for v in by_kernel.values())
    busy_us = _union_us(intervals)
    top_kernels = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]
    host_ops = [(avg.key, avg.count, avg.self_cpu_time_total) for avg in prof.key_averages()
                if avg.key.startswith("aten::") or avg.key.startswith("cuda")]
    host_ops.sort(key=lambda r: -r[2])
    return {
        "host_wall_ms_per_step": wall_ms,
        "device_kernel_ms_per_step": kernel_us / 1e3 / steps if cuda else None,
        "device_busy_ms_per_step": busy_us / 1e3 / steps if cuda else None,
        "device_idle_fraction": (1 - busy_us / 1e3 / steps / wall_ms) if cuda and wall_ms else None,
        "kernel_launches_per_step": launches / steps if cuda else None,
        "device_kernels_per_step": len(kernels) / steps if cuda else None,
        "aten_ops_per_step": aten_ops / steps,
        "top_kernels": [{"name": n[:160], "calls_per_step": len(v) / steps, "us_per_step": sum(v) / steps,
                         "share": (sum(v) / kernel_us) if kernel_us else None} for n, v in top_kernels],
        "top_host_ops": [{"name": name, "calls_per_step": count / steps, "self_cpu_us_per_step": us / steps}
                         for name, count, us in host_ops[:top]],
    }


def summary_markdown(profiles: list[dict]) -> str:
    lines = ["# Decode-step profile (torch profiler)", ""]
    for p in profiles:
        lines += [
            f"## C={p['concurrency']}, context {p['prompt_len']} ({p['backend']} backend, {p['rows']} rows, "
            f"{p['steps_profiled']} engine steps = {p['steps_profiled'] / p['loops_per_token']:.2f} token steps)",
            "",
            "| per engine step (one loop for every row) | value |",
            "| --- | --- |",
            f"| wall time, unprofiled (step + device sync) | {p['unprofiled_wall_ms_per_step']:.2f} ms |",
            f"| wall time under the profiler | {p['host_wall_ms_per_step']:.2f} ms |",
        ]
        if p["device_busy_ms_per_step"] is not None:
            lines += [
                f"| device busy (union of kernel intervals) | {p['device_busy_ms_per_step']:.2f} ms |",
                f"| device kernel time (sum) | {p['device_kernel_ms_per_step']:.2f} ms |",
                f"| device idle share of the step | {100 * p['device_idle_fraction']:.0f} % |",
                f"| kernel launches (host runtime calls) | {p['kernel_launches_per_step']:.0f} |",
                f"| device kernels executed | {p['device_kernels_per_step']:.0f} |",
            ]
        lines += [f"| aten ops dispatched | {p['aten_ops_per_step']:.0f} |",
                  f"| per token (x{p['loops_per_token']} loops): wall, unprofiled | "
                  f"{p['unprofiled_wall_ms_per_step'] * p['loops_per_token']:.2f} ms |", ""]
        lines += ["Host time by part of `step()` (unprofiled steps; `execute:` rows are parts of execute):", "",
                  "| part | ms/step |", "| --- | --- |"]
        lines += [f"| {k} | {v:.2f} |" for k, v in p["host_regions_ms_per_step"].items()]
        lines.append("")
        if p["top_kernels"]:
            lines += ["Largest kernels (device time per engine step):", "",
                      "| kernel | calls/step | us/step | share |", "| --- | --- | --- | --- |"]
            lines += [f"| `{k['name'][:90]}` | {k['calls_per_step']:.0f} | {k['us_per_step']:.0f} | "
                      f"{100 * (k['share'] or 0):.1f} % |" for k in p["top_kernels"]]
            lines.append("")
        lines += ["Largest host ops (self CPU time per engine step):", "",
                  "| op | calls/step | self CPU us/step |", "| --- | --- | --- |"]
        lines += [f"| `{h['name']}` | {h['calls_per_step']:.0f} | {h['self_cpu_us_per_step']:.0f} |"
                  for h in p["top_host_ops"]]
        lines.append("")
    return "\n".join(lines)
