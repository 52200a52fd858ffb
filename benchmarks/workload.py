"""Closed-loop offline workloads on the rlt engine, timed step by step.

A workload is (concurrency C, prompt length, output length, number of requests — 2·C by default —
fixed or adaptive depth, engine options). ``run_workload`` builds one engine for it, runs one
discarded warm-up and then up to ``reps`` measured repetitions, and reports the median of every
metric over the measured repetitions (all repetitions are kept in the result).

Closed loop: C requests are submitted at t0; each time one finishes, the next is submitted, until
``num_requests`` have been issued. Prompts are fixed random token ids (the same every
repetition), decoding is greedy with ``ignore_eos`` so every request produces exactly
``output_len`` tokens.

What is timed: every ``LLMEngine.step()`` with a host clock, followed by a device synchronise
(``sync_steps``, default on: the eager executor already synchronises on every step that samples,
so this mostly makes the per-step attribution exact). A step is a *prefill step* if any row in it
is still in its prompt (the executor is wrapped to record that from the batch), otherwise a
*decode step*. Metrics:

* e2e output tok/s = output tokens / (last finish − first submit);
* decode-only tok/s = tokens produced in decode steps / time of decode steps;
* ms per loop step = mean decode-step time (one engine step = one loop for every running row);
* ms per token step = ms per loop step × mean loops per decode token (the time for every running
  row to advance one token; the roofline's decode step);
* prefill tok/s = prompt tokens / time of prefill steps (exact for a prefill-only workload);
* TTFT = first token − arrival, TPOT = (finish − first token) / (tokens − 1), p50 and p95;
* peak device memory (``max_memory_allocated`` over the workload: weights, KV pool, activations);
* mean exit depth over decode tokens (the first token always comes from full-depth prefill).

To fit a time budget, the warm-up's step times predict a repetition's length; repetitions are
cut (at least one runs) and, if even one would not fit, the output length is shortened. Every
such cut is recorded in the result (``reps_run``, ``output_len_run``, ``notes``).

This module must not change engine behaviour: it only submits requests, calls ``step`` and reads
the engine's outputs (the checkpoint cache below only avoids re-reading identical weights).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Any

import attrs
import numpy as np
import torch

from benchmarks.observe import StepRecorder
from rlt.platform.checkpoint.loader import load_checkpoint as _load_checkpoint
from rlt.platform.config import EngineConfig
from rlt.platform.engine.engine import LLMEngine
from rlt.platform.sampling_params import SamplingParams


class BenchmarkError(RuntimeError):
    pass


@attrs.frozen
class Workload:
    name: str
    concurrency: int
    prompt_len: int
    output_len: int
    num_requests: int | None = None  # None: 2 x concurrency
    #: τ; 1.0 = fixed full depth (the default), < 1.0 = adaptive exit by the Ouro gate.
    exit_threshold: float = 1.0
    min_loops: int = 1
    max_loops: int | None = None

    @property
    def requests(self) -> int:
        return self.num_requests if self.num_requests is not None else 2 * self.concurrency

    @property
    def adaptive(self) -> bool:
        return self.exit_threshold < 1.0

    def describe(self) -> str:
        depth = f"adaptive tau={self.exit_threshold}" if self.adaptive else "fixed depth"
        return (f"{self.name}: C={self.concurrency} in={self.prompt_len} out={self.output_len} "
                f"requests={self.requests} {depth}")

    @classmethod
    def parse(cls, spec: str) -> "Workload":
        """``c=64,in=1024,out=128[,req=64][,tau=0.8][,min_loops=2][,max_loops=4][,name=x]``."""
        keys = {"c": "concurrency", "in": "prompt_len", "out": "output_len", "req": "num_requests",
                "tau": "exit_threshold", "min_loops": "min_loops", "max_loops": "max_loops", "name": "name"}
        vals: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            k, sep, v = part.partition("=")
            if not sep or k not in keys:
                raise ValueError(f"bad workload field {part!r} in {spec!r}; fields: {', '.join(keys)}")
            field = keys[k]
            vals[field] = v if field == "name" else (float(v) if field == "exit_threshold" else int(v))
        missing = {"concurrency", "prompt_len", "output_len"} - set(vals)
        if missing:
            raise ValueError(f"workload {spec!r} lacks {', '.join(sorted(missing))} (give c=, in=, out=)")
        vals.setdefault("name", f"c{vals['concurrency']}-in{vals['prompt_len']}-out{vals['output_len']}"
                        + (f"-tau{vals['exit_threshold']}" if vals.get("exit_threshold", 1.0) < 1.0 else ""))
        return cls(**vals)


def feature_flags(features, flags) -> tuple[dict, dict]:
    """(switches, option objects) of the features from ``rlt-server serve``'s own feature flags (e.g.
    ``--pipeline-device-exit``, ``--persistent-loop``), parsed by the platform's flag machinery."""
    import argparse

    from rlt.platform.features import add_feature_arguments, options_from_args

    parser = argparse.ArgumentParser(prog="--feature-flag", add_help=False, allow_abbrev=False)
    add_feature_arguments(parser, features)
    return options_from_args(features, parser.parse_args(list(flags)))


@attrs.frozen
class EngineOptions:
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    block_size: int = 16
    max_num_batched_tokens: int = 16384
    kv_layout: str = "last_exited"
    fixed_depth: bool = False
    #: modules whose ``FEATURES`` are composed into the engine (e.g. ``rlt.decode.feature``); none:
    #: the base engine. Named explicitly so a benchmark needs no installed entry points.
    feature_modules: tuple[str, ...] = ()
    #: features of those modules switched off (e.g. ``pipeline``: rlt-decode without its pipeline)
    disabled_features: tuple[str, ...] = ()
    #: option flags of those features, as ``rlt-server serve`` takes them (e.g. ``--pipeline-device-exit``)
    feature_flags: tuple[str, ...] = ()

    def build_engine(self, config: EngineConfig, load_checkpoint=None) -> LLMEngine:
        if not self.feature_modules:
            return LLMEngine(config, load_checkpoint=load_checkpoint)
        plan = self.plan(config)
        engine = plan.assembly.build_engine(config, load_checkpoint=load_checkpoint)
        engine.features = plan.table
        return engine

    def plan(self, config: EngineConfig):
        """The composition of ``feature_modules`` (minus ``disabled_features``) for ``config``."""
        import importlib

        from rlt.platform.composition import plan_composition
        from rlt.platform.platforms import detect_platform

        features = [f for m in self.feature_modules for f in importlib.import_module(m).FEATURES]
        switches, options = feature_flags(features, self.feature_flags)
        return plan_composition(detect_platform(config.device), features, model=config.model,
                                enabled={**switches, **{name: False for name in self.disabled_features}},
                                options=options)

    def engine_config(self, model_dir: str, wl: Workload, *, backend: str, num_loops: int) -> EngineConfig:
        max_len = wl.prompt_len + wl.output_len
        planes = 1 if self.kv_layout == "shared" else (wl.max_loops or num_loops)
        pages = -(-(max_len - 1) // self.block_size)
        return EngineConfig(
            model=model_dir, device=self.device, dtype=self.dtype, attention_backend=backend,
            kv_layout=self.kv_layout, block_size=self.block_size,
            num_kv_blocks=wl.concurrency * pages * planes, max_num_seqs=wl.concurrency,
            max_model_len=max_len, max_num_batched_tokens=max(self.max_num_batched_tokens, wl.prompt_len),
            exit_threshold=wl.exit_threshold, fixed_depth=self.fixed_depth,
        )


class CheckpointCache:
    """Loads each (directory, dtype, device) once and hands the same tensors to every engine.

    Engines of different workloads are built from the same weights; re-reading 3 GB per
    workload would only cost device time. Pass :meth:`load` as the engine's ``load_checkpoint``.
    """

    def __init__(self) -> None:
        self._cache: dict[tuple, Any] = {}

    def load(self, path, *, dtype, device="cpu"):
        key = (str(path), str(dtype), str(device))
        if key not in self._cache:
            self._cache[key] = _load_checkpoint(path, dtype=dtype, device=device)
        return self._cache[key]

    def clear(self) -> None:
        self._cache.clear()


# -- one repetition ------------------------------------------------------------------------------
@attrs.define
class StepLog:
    seconds: list[float] = attrs.field(factory=list)
    prefill: list[bool] = attrs.field(factory=list)
    rows: list[int] = attrs.field(factory=list)
    tokens_out: list[int] = attrs.field(factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompts_for(wl: Workload, vocab: int, seed: int, count: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lo = 3  # skip the special ids 0..2
    return [rng.integers(lo, vocab, size=wl.prompt_len).tolist() for _ in range(count)]


def run_once(engine: LLMEngine, wl: Workload, prompts: list[list[int]], output_len: int,
             *, sync_steps: bool = True) -> dict:
    """One closed-loop pass; returns the metrics of this repetition."""
    device = engine.device
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True,
                            exit_threshold=wl.exit_threshold, min_loops=wl.min_loops, max_loops=wl.max_loops)
    log = StepLog()
    recorder = StepRecorder()
    engine.add_observer(recorder)
    finished = []
    issued = 0
    try:
        _sync(device)
        t0 = time.perf_counter()
        while issued < min(wl.concurrency, len(prompts)):
            engine.add_request(f"{wl.name}-{issued}", prompts[issued], params)
            issued += 1
        while engine.has_unfinished_requests():
            ran = len(recorder.rows)
            ts = time.perf_counter()
            outs = engine.step()
            if sync_steps:
                _sync(device)
            dt = time.perf_counter() - ts
            log.seconds.append(dt)
            stepped = len(recorder.rows) > ran
            log.prefill.append(recorder.prefill[-1] if stepped else False)
            log.rows.append(recorder.rows[-1] if stepped else 0)
            log.tokens_out.append(sum(len(o.new_token_ids) for o in outs))
            for o in outs:
                if not o.finished:
                    continue
                if o.finish_reason == "abort":
                    raise BenchmarkError(f"request {o.request_id} was aborted by the engine: {o.error}")
                finished.append(o)
                if issued < len(prompts):
                    engine.add_request(f"{wl.name}-{issued}", prompts[issued], params)
                    issued += 1
        _sync(device)
        t_end = time.perf_counter()
    finally:
        engine.remove_observer(recorder)
        for rid in [f"{wl.name}-{i}" for i in range(issued)]:
            engine.abort_request(rid)
    return _metrics(wl, finished, log, t_end - t0)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _metrics(wl: Workload, outs, log: StepLog, wall: float) -> dict:
    out_tokens = sum(len(o.token_ids) for o in outs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    sec = np.asarray(log.seconds)
    pre = np.asarray(log.prefill, bool)
    toks = np.asarray(log.tokens_out)
    dec_time, dec_tokens, dec_steps = float(sec[~pre].sum()), int(toks[~pre].sum()), int((~pre).sum())
    pre_time = float(sec[pre].sum())
    decode_depths = [d for o in outs for d in o.exit_depths[1:]]
    all_depths = [d for o in outs for d in o.exit_depths]
    mean_depth = float(np.mean(decode_depths)) if decode_depths else (float(np.mean(all_depths)) if all_depths else None)
    ms_loop = 1e3 * dec_time / dec_steps if dec_steps else None
    ttft = [1e3 * (o.metrics.first_token_time - o.metrics.arrival_time) for o in outs]
    tpot = [1e3 * (o.metrics.finished_time - o.metrics.first_token_time) / (len(o.token_ids) - 1)
            for o in outs if len(o.token_ids) > 1]
    return {
        "wall_s": wall,
        "requests": len(outs),
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "e2e_tok_s": out_tokens / wall if wall > 0 else None,
        "decode_tok_s": dec_tokens / dec_time if dec_tokens and dec_time > 0 else None,
        "decode_tokens": dec_tokens,
        "decode_steps": dec_steps,
        "prefill_steps": int(pre.sum()),
        "prefill_tok_s": prompt_tokens / pre_time if pre_time > 0 else None,
        "ms_per_loop_step": ms_loop,
        "ms_per_token_step": ms_loop * mean_depth if ms_loop is not None and mean_depth else None,
        # Medians are robust to one-off JIT compiles (the warm-up's job); used to predict rep length.
        "median_decode_step_ms": float(1e3 * np.median(sec[~pre])) if dec_steps else None,
        "median_prefill_step_ms": float(1e3 * np.median(sec[pre])) if pre.any() else None,
        "mean_rows_per_decode_step": float(np.mean(np.asarray(log.rows)[~pre])) if dec_steps else None,
        "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p95": _pct(ttft, 95),
        "tpot_ms_p50": _pct(tpot, 50), "tpot_ms_p95": _pct(tpot, 95),
        "mean_exit_depth": mean_depth,
        "steps": len(sec),
    }


MEDIAN_KEYS = ("wall_s", "e2e_tok_s", "decode_tok_s", "prefill_tok_s", "ms_per_loop_step", "ms_per_token_step",
               "ttft_ms_p50", "ttft_ms_p95", "tpot_ms_p50", "tpot_ms_p95", "mean_exit_depth",
               "mean_rows_per_decode_step")


def median_of(reps: list[dict]) -> dict:
    out = {}
    for k in MEDIAN_KEYS:
        vals = [r[k] for r in reps if r.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    for k in ("requests", "output_tokens", "prompt_tokens", "decode_steps", "prefill_steps", "steps"):
        out[k] = reps[-1][k] if reps else None
    return out


# -- memory pre-flight -----------------------------------------------------------------------------
def kv_pool_bytes(engine_cfg: EngineConfig, model_cfg, elem_bytes: int) -> int:
    per_block = (2 * (model_cfg.num_hidden_layers + getattr(model_cfg, 'boundary_layers', 0)) * engine_cfg.block_size * model_cfg.num_key_value_heads
                 * model_cfg.head_dim * elem_bytes + engine_cfg.block_size * 4)
    return engine_cfg.num_kv_blocks * per_block


def transient_bytes(wl: Workload, model_cfg, backend: str, batched_tokens: int, elem_bytes: int) -> int:
    """A rough upper bound of per-step temporaries (what the KV pool must leave free)."""
    h, i = model_cfg.hidden_size, model_cfg.intermediate_size
    tokens = min(batched_tokens, wl.concurrency * wl.prompt_len)
    act = tokens * (2 * i + 4 * h + 3 * model_cfg.num_attention_heads * model_cfg.head_dim) * elem_bytes * 3
    if backend == "torch":
        # Dense padded gather: [R, max_q, max_c] fp32 scores (a few live copies) and fp32 K/V.
        rows = wl.concurrency
        max_q = wl.prompt_len
        max_c = wl.prompt_len + wl.output_len
        scores = rows * model_cfg.num_attention_heads * max_q * max_c * 4 * 4
        kv = rows * max_c * model_cfg.num_key_value_heads * model_cfg.head_dim * (elem_bytes + 8) * 2 * 2
        return act + scores + kv + (2 << 30)
    return act + (4 << 30)


def fit_to_memory(model_dir: str, model_cfg, wl: Workload, opts: EngineOptions, *, backend: str
                  ) -> tuple[Workload, str | None]:
    """Shrink C (and the request count with it) until KV pool + temporaries fit free device memory."""
    from benchmarks.roofline import ModelCost
    from rlt.platform.checkpoint.loader import resolve_dtype
    from rlt.platform.platforms import detect_platform

    platform = detect_platform(opts.device)
    module = platform.device_module
    if module is None or not hasattr(module, "mem_get_info"):
        return wl, None
    free, _ = module.mem_get_info()
    elem = torch.empty((), dtype=resolve_dtype(opts.dtype, model_cfg.torch_dtype)).element_size()
    cost = ModelCost.from_config(model_cfg, elem)
    weights = (cost.params_per_loop + cost.boundary_params + 2 * cost.vocab * cost.hidden) * elem
    usable = 0.95 * free - 2 * weights  # the engine's fused copies, and the weights if not yet loaded

    def need(c: int) -> int:
        w = attrs.evolve(wl, concurrency=c)
        cfg = opts.engine_config(model_dir, w, backend=backend, num_loops=model_cfg.total_ut_steps)
        return kv_pool_bytes(cfg, model_cfg, elem) + transient_bytes(w, model_cfg, backend, cfg.max_num_batched_tokens, elem)

    c = wl.concurrency
    if need(c) <= usable:
        return wl, None
    while c > 1 and need(c) > usable:
        c = max(1, int(c * 0.9))
    reqs = max(c, round(wl.requests * c / wl.concurrency))
    note = (f"memory: C={wl.concurrency} needs {need(wl.concurrency) / 2**30:.1f} GiB (KV pool + {backend} "
            f"temporaries) but {usable / 2**30:.1f} GiB is usable; ran C={c}, {reqs} requests")
    return attrs.evolve(wl, concurrency=c, num_requests=reqs), note


# -- a whole workload ----------------------------------------------------------------------------
def run_workload(model_dir: str, model_cfg, wl: Workload, opts: EngineOptions, *, backend: str,
                 reps: int = 3, warmup_output_len: int = 4, budget_s: float | None = None,
                 seed: int = 0, sync_steps: bool = True, progress=print, load_checkpoint=None) -> dict:
    """Build an engine for ``wl``, warm up once, run up to ``reps`` measured repetitions."""
    t_start = time.perf_counter()
    notes: list[str] = []
    requested = wl
    wl, fit_note = fit_to_memory(model_dir, model_cfg, wl, opts, backend=backend)
    if fit_note:
        notes.append(fit_note)
        progress(f"  {fit_note}")
    cfg = opts.engine_config(model_dir, wl, backend=backend, num_loops=model_cfg.total_ut_steps)
    engine = opts.build_engine(cfg, load_checkpoint=load_checkpoint)
    device = engine.device
    elem = torch.empty((), dtype=engine.dtype).element_size()
    kv_bytes = kv_pool_bytes(cfg, model_cfg, elem)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        prompts = prompts_for(wl, model_cfg.vocab_size, seed, wl.requests)
        warm_prompts = prompts[:wl.concurrency]
        warm_out = max(1, min(warmup_output_len, wl.output_len))
        tw = time.perf_counter()
        warm = run_once(engine, wl, warm_prompts, warm_out, sync_steps=sync_steps)
        warm_s = time.perf_counter() - tw
        progress(f"  warm-up ({len(warm_prompts)} req x {warm_out} out): {warm_s:.1f} s, "
                 f"loop step {_fmt(warm['ms_per_loop_step'])} ms")
        output_len = wl.output_len
        n_reps = reps
        if budget_s is not None:
            predicted = _predict_rep_s(wl, warm, output_len, model_cfg.total_ut_steps)
            left = budget_s - (time.perf_counter() - t_start)
            if predicted * reps > left:
                n_reps = max(1, int(left // max(predicted, 1e-9)))
                if n_reps < reps:
                    notes.append(f"time cap {budget_s:.0f}s: {n_reps} of {reps} repetitions (predicted {predicted:.1f} s each)")
            if predicted > left and wl.output_len > 16:
                per_token = max(predicted - _prefill_part(wl, warm), 1e-9) / max(wl.output_len - 1, 1)
                output_len = max(16, min(wl.output_len, int((left - _prefill_part(wl, warm)) / per_token)))
                notes.append(f"time cap {budget_s:.0f}s: output_len {wl.output_len} -> {output_len}")
        measured = []
        for r in range(n_reps):
            res = run_once(engine, wl, prompts, output_len, sync_steps=sync_steps)
            measured.append(res)
            progress(f"  rep {r + 1}/{n_reps}: e2e {_fmt(res['e2e_tok_s'])} tok/s, decode {_fmt(res['decode_tok_s'])} tok/s, "
                     f"loop step {_fmt(res['ms_per_loop_step'])} ms, wall {res['wall_s']:.1f} s")
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        return {
            "workload": attrs.asdict(wl) | {"requests": wl.requests},
            "requested_workload": attrs.asdict(requested) | {"requests": requested.requests},
            "backend": engine.selection.name,
            "backend_reason": engine.selection.reason,
            "engine_config": {k: (v.value if hasattr(v, "value") else v) for k, v in attrs.asdict(cfg).items()},
            "output_len_run": output_len,
            "reps_run": len(measured),
            "median": median_of(measured),
            "reps": measured,
            "warmup": warm,
            "peak_memory_bytes": peak,
            "kv_pool_bytes": kv_bytes,
            "notes": notes,
            "elapsed_s": time.perf_counter() - t_start,
        }
    finally:
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _prefill_part(wl: Workload, warm: dict) -> float:
    """Seconds of prefill steps a repetition needs, from the warm-up's median prefill step.

    Medians, not sums: the warm-up's first steps include kernel JIT compiles, which a measured
    repetition does not pay again.
    """
    med = warm.get("median_prefill_step_ms")
    if med is None:
        return 0.0
    return warm["prefill_steps"] * med / 1e3 * wl.requests / max(warm["requests"], 1)


def _predict_rep_s(wl: Workload, warm: dict, output_len: int, loops: int) -> float:
    """A repetition's length from the warm-up: its prefill steps plus the decode steps it needs."""
    loop_ms = warm.get("median_decode_step_ms") or 1e3 * warm["wall_s"] / max(warm["steps"], 1)
    rounds = math.ceil(wl.requests / wl.concurrency)
    depth = warm["mean_exit_depth"] or loops
    return _prefill_part(wl, warm) + rounds * max(output_len - 1, 0) * depth * loop_ms / 1e3


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"
