"""rlt-prefill benchmarks on Ouro shapes with random weights (the issue-11 acceptance numbers).

Workloads (``--workload``, several allowed):

- ``single``: one prompt of ``--prompt-len`` tokens (default 8192), one output token; prefill
  tok/s = prompt tokens / time to first token (one warm-up, median of ``--reps``). Default path:
  adaptive exit allowed, rlt-prefill's features at their defaults (packed_prefill puts prompt rows
  on FA4 when it imports).
- ``profile``: one ``--prompt-len`` prefill of the ``single`` engine under the torch profiler (after
  a warm-up prefill; ``--profile-prompts N``: N such prompts submitted together, packed into shared
  steps as C=128's 1K prompts are, e.g. 16 x 1024 = one step budget): wall time, device busy time, and device time by kernel and by kind (GEMM,
  attention, rope, norms, SwiGLU, KV write, other): where the prefill's time goes besides attention;
  and the device's idle gaps over 50 us (count, total, the largest with the kernels around them).
- ``long``: one ``--long-len`` (32768) prompt under a ``--budget`` (2048) step budget: served?, TTFT.
- ``logprobs``: the ``long`` prompt with ``prompt_logprobs`` (``--logprobs-k``): its peak device
  memory above the same prompt without them, against the stated bound (four LM-head slices of
  ``DEFAULT_CHUNK_SIZE`` positions x vocab fp32 values).
- ``smooth``: ``--decoders`` (32) requests decoding while ``--arrival-len`` (16384) prompts arrive
  every ``--arrive-every`` seconds for ``--duration`` seconds (after the engine warm-up a server
  runs and one untimed long prompt among the decoders, so Triton compiles its shapes first;
  ``--no-smooth-warmup`` skips both), for each of ``--modes``: the
  decoders' inter-token latency p50 / p99 and the long prompts' TTFT. Modes: ``full`` (no
  chunked prefill, a budget that fits the prompt), ``chunked`` (the engine's default budget, the
  decode-smoothness cap at ratio 1.5, which is opt-in), ``wavefront`` (the cap, WCPB with
  ``--wavefront-chunk`` chunks), ``chunked-r2`` (the cap at ratio 2), ``budget2048`` (vLLM-style:
  a 2,048-token budget shared with decode rows, no cap; the setting measured before the cap).
  Every step is recorded (wall time, decode tokens, prompt rows, their attention units) and the
  step-time model of ``rlt.prefill.scheduler`` is fitted to them: ``T = T0 + a0 * rows + a1 *
  sum(n * mean context)``, printed as T0, a0, C0 = T0 / a0 (``--chunked-prefill-step-overhead-
  tokens``) and K = a0 / a1 (``--chunked-prefill-attention-tokens``). ITL windows that held no
  prompt row give the decode-only noise floor (``clean_itl_*``). Steps over 5x the median step
  (``slow_steps``) and the Triton compilations in the timed window (``triton_compiles``) are listed.

Prints one JSON object per result line and writes them all to ``--out``. Nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


DEVICE = {"device": "cuda", "dtype": "bfloat16"}
DEVICE_BLOCKS = [24000]


def _engine(model, *, budget=None, chunk=0, wavefront=False, packed=True, chunked=True, smooth=None, **cfg):
    from rlt.platform import EngineConfig
    from rlt.platform.composition import build_engine
    from rlt.prefill.features import FEATURES, ChunkedPrefillOptions

    import gc

    import torch

    gc.collect()  # the previous workload's engine and its KV pool go first
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    cfg.setdefault("num_kv_blocks", DEVICE_BLOCKS[0])
    config = EngineConfig(model=model, max_num_batched_tokens=budget, **DEVICE, **cfg)
    opts = ChunkedPrefillOptions(chunk_size=chunk, wavefront=wavefront, **(smooth or {}))
    return build_engine(config, features=FEATURES, enabled={"chunked_prefill": chunked, "packed_prefill": packed},
                        options={"chunked_prefill": opts})


class StepLog:
    """Step observer: end time and composition of every step (decode tokens, prompt rows, their
    attention units sum(n * mean causal context))."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, int, int, float]] = []

    def on_step(self, batch, result) -> None:
        dec = rows = 0
        attn = 0.0
        for r in batch.rows:
            if r.in_prompt:
                rows += r.length
                attn += r.length * (r.start + (r.length + 1) / 2)
            else:
                dec += r.length
        self.rows.append((time.perf_counter(), dec, rows, attn))


class CompileLog:
    """Triton compilations while it is installed (``triton.knobs.runtime.jit_post_compile_hook``;
    from construction to :meth:`close`, or as a context manager): (time, kernel name, its
    constexprs). A step that compiles stalls every row in it."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, str]] = []
        self._knobs = None
        try:
            from triton import knobs
        except ImportError:  # no Triton: nothing compiles
            return
        self._knobs = knobs.runtime
        self._previous = self._knobs.jit_post_compile_hook
        self._knobs.jit_post_compile_hook = self._hook

    def _hook(self, *, fn, compile, **_) -> None:
        consts = {k if isinstance(k, str) else str(k): v for k, v in (compile.get("constants") or {}).items()}
        self.events.append((time.perf_counter(), fn.name, repr(consts)[:300]))

    def close(self) -> None:
        if self._knobs is not None:
            self._knobs.jit_post_compile_hook = self._previous
            self._knobs = None

    def __enter__(self) -> "CompileLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def slow_steps(log: StepLog, t0: float, factor: float = 5.0) -> list[dict]:
    """Steps after ``t0`` that took over ``factor`` x the median step: when, how long, what they carried."""
    recs = [r for r in log.rows if r[0] >= t0]
    if len(recs) < 3:
        return []
    dt = np.diff([r[0] for r in recs])
    cut = factor * float(np.median(dt))
    return [{"t_s": round(recs[i + 1][0] - t0, 3), "ms": round(float(d) * 1e3, 1), "decode_tokens": recs[i + 1][1],
             "prompt_tokens": recs[i + 1][2]} for i, d in enumerate(dt) if d > cut]


def fit_steps(log: StepLog, t0: float) -> dict:
    """Least squares of step wall time on [1, decode + prompt rows, attention units] over the steps
    after ``t0`` (each step's time: since the previous step ended)."""
    recs = [r for r in log.rows if r[0] >= t0]
    if len(recs) < 8:
        return {}
    t = np.array([r[0] for r in recs])
    dt = np.diff(t)
    x = np.array([[1.0, r[1] + r[2], r[3]] for r in recs[1:]])
    prompt = np.array([r[2] for r in recs[1:]])
    out = {"steps": int(len(dt)), "mixed_steps": int((prompt > 0).sum()),
           "decode_only_step_ms_p50": float(np.median(dt[prompt == 0]) * 1e3) if (prompt == 0).any() else None,
           "mixed_step_ms_p50": float(np.median(dt[prompt > 0]) * 1e3) if (prompt > 0).any() else None,
           "mixed_step_ms_p99": float(np.percentile(dt[prompt > 0], 99) * 1e3) if (prompt > 0).any() else None,
           "prompt_rows_per_mixed_step_max": int(prompt.max()) if len(prompt) else 0}
    if (prompt > 0).sum() >= 3 and (prompt == 0).sum() >= 3:
        coef, *_ = np.linalg.lstsq(x, dt, rcond=None)
        t0_, a0, a1 = (float(c) for c in coef)
        out.update(T0_ms=t0_ * 1e3, a0_us=a0 * 1e6, a1_ns_per_key=a1 * 1e9,
                   C0_tokens=t0_ / a0 if a0 > 0 else None, K_tokens=a0 / a1 if a1 > 0 else None)
    return out


def _ids(n, seed):
    return np.random.default_rng(seed).integers(3, 320, n).tolist()


def _ttft(engine, rid, *prompts):
    """Seconds until every prompt (submitted together: packed into shared steps) has its first token."""
    from rlt.platform import SamplingParams

    t = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{rid}-{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t


def single(model, args):
    engine = _engine(model, max_num_seqs=4)
    _ttft(engine, "warm", _ids(args.prompt_len, 0))
    times = []
    for i in range(args.reps):
        times.append(_ttft(engine, f"s{i}", _ids(args.prompt_len, i + 1)))
    t = statistics.median(times)
    return {"workload": "single", "prompt_len": args.prompt_len, "tok_per_s": args.prompt_len / t,
            "ttft_s": t, "attention": engine.ctx.parts.executor.attention.describe(),
            "selection": engine.selection.name}


#: Kernel kinds by name, first match wins: attention before GEMMs (FlashAttention-4's kernel is named
#: ``kernel_cutlass_kernel_flash_attn...``: lease 7's profiles counted its 48 ms as GEMM time).
_KINDS = (("attention", ("flash", "Flash", "prefill_kernel", "decode")), ("gemm", ("nvjet", "gemm", "Gemm", "xmma", "cutlass")),
          ("rope", ("_rope_kernel",)), ("norms", ("_add_norm_norm_kernel", "reduce_kernel", "rsqrt")),
          ("swiglu", ("_silu_mul_kernel",)), ("kv_write", ("write_kv_kernel",)))


def kernel_kind(name: str) -> str:
    """The kind (``_KINDS``) of a kernel, by its name; "other" when none matches."""
    return next((k for k, keys in _KINDS if any(x in name for x in keys)), "other")


def profile(model, args):
    """Where one prefill's device time goes (see the module docstring)."""
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from benchmarks.profile_step import _is_device_event, _union_us

    n = args.profile_prompts
    engine = _engine(model, max_num_seqs=max(4, n))
    _ttft(engine, "warm", *(_ids(args.prompt_len, i) for i in range(n)))
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=acts, with_stack=bool(args.trace)) as prof:
        wall = _ttft(engine, "prof", *(_ids(args.prompt_len, n + i) for i in range(n)))
    if args.trace:  # the timeline (host ops and kernels) for chrome://tracing or Perfetto
        prof.export_chrome_trace(args.trace)
    kernels = [e for e in prof.events() if _is_device_event(e)]
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
    kinds = {k: 0.0 for k, _ in _KINDS} | {"other": 0.0}
    for name, us in by_name.items():
        kinds[kernel_kind(name)] += us
    busy = _union_us([(e.time_range.start, e.time_range.end) for e in kernels])
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    # device idle gaps between consecutive kernels: host work or a sync the device waited for
    seq = sorted(kernels, key=lambda e: e.time_range.start)
    gaps, end, prev = [], None, None
    for e in seq:
        if end is not None and e.time_range.start - end > 50.0:
            gaps.append((e.time_range.start - end, (end - seq[0].time_range.start) / 1e3, prev, e.name))
        if end is None or e.time_range.end > end:
            end, prev = e.time_range.end, e.name
    gaps.sort(key=lambda g: -g[0])
    # host time outside the kernels' span: before the first kernel starts (the first step's host work)
    # and after the last one ends (sampling readback, output); CPU ops by self time in the first window
    host = [e for e in prof.events() if not _is_device_event(e)]
    t_start = min(e.time_range.start for e in host)
    t_end = max(e.time_range.end for e in host)
    first_k, last_k = (seq[0].time_range.start, max(e.time_range.end for e in seq)) if seq else (t_end, t_end)
    before: dict[str, float] = {}
    for e in host:
        if e.time_range.start < first_k:
            before[e.name] = before.get(e.name, 0.0) + e.self_cpu_time_total
    return {"workload": "profile",
            "host_before_first_kernel_ms": round((first_k - t_start) / 1e3, 3),
            "host_after_last_kernel_ms": round((t_end - last_k) / 1e3, 3),
            "host_ops_before_first_kernel_ms": [(n[:60], round(us / 1e3, 3)) for n, us in
                                                sorted(before.items(), key=lambda kv: -kv[1])[:12]], "prompt_len": args.prompt_len, "prompts": n,
            "wall_ms_profiled": wall * 1e3, "prompt_tok_per_s": n * args.prompt_len / wall,
            "device_busy_ms": busy / 1e3, "device_kernel_ms": sum(by_name.values()) / 1e3,
            "kernels": len(kernels), "ms_by_kind": {k: round(v / 1e3, 3) for k, v in kinds.items()},
            "top_kernels_ms": [(n[:90], round(us / 1e3, 3)) for n, us in top],
            "idle_gaps_over_50us": {"count": len(gaps), "total_ms": round(sum(g[0] for g in gaps) / 1e3, 3),
                                    "largest": [{"us": round(g, 1), "at_ms": round(at, 2), "after": a[:60],
                                                 "before": b[:60]} for g, at, a, b in gaps[:12]]},
            "attention": engine.ctx.parts.executor.attention.describe()}


def long(model, args):
    engine = _engine(model, budget=args.budget, max_num_seqs=4)
    t = _ttft(engine, "long", _ids(args.long_len, 7))
    return {"workload": "long", "prompt_len": args.long_len, "budget": args.budget, "served": True, "ttft_s": t}


def logprobs(model, args):
    """One ``--long-len`` prompt under the ``--budget`` with ``prompt_logprobs`` = ``--logprobs-k``:
    its peak device memory above the same prompt without prompt logprobs (issue 16's bound)."""
    import torch

    from rlt.platform import SamplingParams
    from rlt.platform.engine.prompt_logprobs import DEFAULT_CHUNK_SIZE

    engine = _engine(model, budget=args.budget, max_num_seqs=4)
    prompt = _ids(args.long_len, 9)
    runs = {}
    for name, k in (("warm", None), ("plain", None), ("logprobs", args.logprobs_k)):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t = time.perf_counter()
        engine.add_request(name, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                                        prompt_logprobs=k))
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.request_id == name]
        elapsed = time.perf_counter() - t
        peak = (torch.cuda.max_memory_allocated() - base) if torch.cuda.is_available() else None
        entries = next((o.prompt_logprobs for o in reversed(outs) if o.prompt_logprobs is not None), None)
        runs[name] = {"seconds": elapsed, "peak_above_idle_mib": None if peak is None else peak / 2**20,
                      "prompt_logprob_entries": None if entries is None else len(entries),
                      "first_is_none": None if entries is None else entries[0] is None}
    vocab = engine.ctx.model.shape.vocab_size
    bound = 4 * DEFAULT_CHUNK_SIZE * vocab * 4 / 2**20
    extra = (None if runs["plain"]["peak_above_idle_mib"] is None
             else runs["logprobs"]["peak_above_idle_mib"] - runs["plain"]["peak_above_idle_mib"])
    return {"workload": "logprobs", "prompt_len": args.long_len, "budget": args.budget, "k": args.logprobs_k,
            "runs": runs, "extra_peak_mib": extra, "stated_bound_mib": bound,
            "within_bound": None if extra is None else extra <= bound}


def smooth(model, args, mode):
    from rlt.platform import SamplingParams
    from rlt.prefill.scheduler import SMOOTH_STEP_RATIO

    kw = {"full": dict(budget=args.arrival_len + args.decoders + 64, chunked=False),
          "chunked": dict(chunk=args.chunk, smooth={"decode_step_ratio": SMOOTH_STEP_RATIO}),
          "wavefront": dict(chunk=args.wavefront_chunk, wavefront=True, smooth={"decode_step_ratio": SMOOTH_STEP_RATIO}),
          "chunked-r2": dict(chunk=args.chunk, smooth={"decode_step_ratio": 2.0}),
          "budget2048": dict(budget=2048, chunk=args.chunk, smooth={"decode_step_ratio": 0})}[mode]
    engine = _engine(model, max_num_seqs=args.decoders + 8, **kw)
    if args.smooth_warmup:  # what `rlt-server serve` runs before it listens (--warmup auto)
        from rlt.platform.engine.warmup import warm_up

        warm_up(engine, max_concurrency=args.decoders + 8)
    steps = StepLog()
    engine.add_observer(steps)
    dec = SamplingParams(max_tokens=min(args.decode_tokens, engine.max_model_len - 129), temperature=0.0,
                         ignore_eos=True)
    for i in range(args.decoders):
        engine.add_request(f"d{i}", _ids(128, 100 + i), dec)
    started: set[str] = set()
    while len(started) < args.decoders:  # every decoder past its prompt
        started |= {o.request_id for o in engine.step() if o.token_ids}
    if args.smooth_warmup:  # one long prompt among the decoders, untimed: the Triton compiles of its shapes
        engine.add_request("warm", _ids(args.arrival_len, 999), SamplingParams(max_tokens=1, temperature=0.0,
                                                                              ignore_eos=True))
        done = False
        while not done:
            done = any(o.request_id == "warm" and o.finished for o in engine.step())
    last: dict[str, float] = {}
    itl: list[float] = []
    windows: list[tuple[float, float]] = []
    arrivals: dict[str, float] = {}
    ttft: list[float] = []
    compiles = CompileLog()
    start = time.perf_counter()
    next_arrival, n, refill = start, 0, args.decoders
    for _ in range(args.decoders - sum(r.startswith("d") for r in engine.running_request_ids())):
        refill += 1  # decoders that finished during the warm-up are replaced
        engine.add_request(f"d{refill}", _ids(128, 100 + refill), dec)
    while time.perf_counter() - start < args.duration:
        now = time.perf_counter()
        if now >= next_arrival:
            rid = f"long{n}"
            engine.add_request(rid, _ids(args.arrival_len, 1000 + n),
                               SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            arrivals[rid] = now
            n += 1
            next_arrival += args.arrive_every
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id.startswith("d"):
                if o.request_id in last:
                    itl.append(now - last[o.request_id])
                    windows.append((last[o.request_id], now))
                last[o.request_id] = now
                if o.finished:  # keep the decoding population constant: a fresh decoder takes its place
                    refill += 1
                    engine.add_request(f"d{refill}", _ids(128, 100 + refill), dec)
            elif o.request_id in arrivals and len(o.token_ids) >= 1:
                ttft.append(now - arrivals.pop(o.request_id))
    compiles.close()
    for rid in list(engine.running_request_ids()):
        engine.abort_request(rid)
    p50, p99 = float(np.percentile(itl, 50)), float(np.percentile(itl, 99))
    # ITL windows in which no step carried a prompt row: the decode-only noise floor
    mixed_ends = np.array([r[0] for r in steps.rows if r[2] > 0])
    clean = [v for v, (a, b) in zip(itl, windows)
             if not ((mixed_ends > a) & (mixed_ends <= b)).any()] if len(mixed_ends) else itl
    c50 = float(np.percentile(clean, 50)) if clean else None
    c99 = float(np.percentile(clean, 99)) if clean else None
    policy = engine.ctx.parts.scheduler
    while not hasattr(policy, "prompt_chunker") and hasattr(policy, "inner"):  # under delegating wrappers
        policy = policy.inner
    chunker = getattr(policy, "prompt_chunker", None)
    cost = getattr(chunker, "step_cost", None)
    return {"workload": "smooth", "mode": mode, "budget": engine.ctx.max_num_batched_tokens,
            "chunk": kw.get("chunk", 0), "step_cost": None if cost is None else repr(cost),
            "decoders": args.decoders, "arrival_len": args.arrival_len, "arrive_every_s": args.arrive_every,
            "itl_p50_ms": 1e3 * p50, "itl_p99_ms": 1e3 * p99, "p99_over_p50": p99 / p50,
            "clean_itl_p50_ms": None if c50 is None else 1e3 * c50,
            "clean_itl_p99_ms": None if c99 is None else 1e3 * c99,
            "clean_share": len(clean) / len(itl),
            "long_prompts_arrived": n, "ttft_s": [round(t, 3) for t in ttft],
            "ttft_median_s": statistics.median(ttft) if ttft else None, "step_fit": fit_steps(steps, start),
            "slow_steps": slow_steps(steps, start),
            "triton_compiles": [(round(t - start, 3), name, consts) for t, name, consts in compiles.events]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", nargs="+", default=["single", "long", "smooth"])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: random ouro-1.4b written to a temp dir)")
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--long-len", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=0, help="prefill chunk size (0: the budget)")
    ap.add_argument("--wavefront-chunk", type=int, default=256, help="chunk size of the wavefront smooth mode")
    ap.add_argument("--logprobs-k", type=int, default=5, help="top-k of the logprobs workload")
    ap.add_argument("--decoders", type=int, default=32)
    ap.add_argument("--arrival-len", type=int, default=16384)
    ap.add_argument("--arrive-every", type=float, default=3.0)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--smooth-warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="smooth: run one long prompt among the decoders before the timed window")
    ap.add_argument("--num-kv-blocks", type=int, default=24000)
    ap.add_argument("--decode-tokens", type=int, default=512, help="max_tokens of each decoding request")
    ap.add_argument("--modes", nargs="+", default=["full", "chunked", "wavefront", "chunked-r2", "budget2048"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--trace", default=None, help="profile: also write the chrome trace (host ops + kernels) here")
    ap.add_argument("--profile-prompts", type=int, default=1, help="profile: prompts of --prompt-len submitted together")
    ap.add_argument("--out", default="prefill_bench.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--config", default="ouro-1.4b", help="named config of the random checkpoint")
    args = ap.parse_args(argv)
    DEVICE.update(device=args.device, dtype=args.dtype)
    DEVICE_BLOCKS[0] = args.num_kv_blocks
    model = args.model
    if model is None:
        from benchmarks.bench_model import write_random_checkpoint

        model = str(write_random_checkpoint(tempfile.mkdtemp(prefix="ouro-"), args.config, gate_bias=1.0,
                                            device=args.device))
    results = []
    for w in args.workload:
        for r in ([single(model, args)] if w == "single" else [long(model, args)] if w == "long"
                  else [profile(model, args)] if w == "profile"
                  else [logprobs(model, args)] if w == "logprobs"
                  else [smooth(model, args, m) for m in args.modes]):
            print(json.dumps(r), flush=True)
            results.append(r)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
