"""rlt-prefill benchmarks on Ouro shapes with random weights (the issue-11 acceptance numbers).

Workloads (``--workload``, several allowed):

- ``single``: one prompt of ``--prompt-len`` tokens (default 8192), one output token; prefill
  tok/s = prompt tokens / time to first token (one warm-up, median of ``--reps``). Default path:
  adaptive exit allowed, rlt-prefill's features at their defaults (packed_prefill puts prompt rows
  on FA4 when it imports).
- ``long``: one ``--long-len`` (32768) prompt under a ``--budget`` (2048) step budget: served?, TTFT.
- ``logprobs``: the ``long`` prompt with ``prompt_logprobs`` (``--logprobs-k``): its peak device
  memory above the same prompt without them, against the stated bound (four LM-head slices of
  ``DEFAULT_CHUNK_SIZE`` positions x vocab fp32 values).
- ``smooth``: ``--decoders`` (32) requests decoding while ``--arrival-len`` (16384) prompts arrive
  every ``--arrive-every`` seconds for ``--duration`` seconds, for each of full / chunked /
  wavefront prefill: the decoders' inter-token latency p50 / p99 and the long prompts' TTFT.

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


def _engine(model, *, budget=None, chunk=0, wavefront=False, packed=True, **cfg):
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
    return build_engine(config, features=FEATURES, enabled={"chunked_prefill": True, "packed_prefill": packed},
                        options={"chunked_prefill": ChunkedPrefillOptions(chunk_size=chunk, wavefront=wavefront)})


def _ids(n, seed):
    return np.random.default_rng(seed).integers(3, 320, n).tolist()


def _ttft(engine, rid, prompt):
    from rlt.platform import SamplingParams

    t = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
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

    kw = {"full": dict(budget=args.arrival_len + args.decoders + 64),
          "chunked": dict(budget=args.budget, chunk=args.chunk),
          "wavefront": dict(budget=args.budget, chunk=args.chunk, wavefront=True)}[mode]
    engine = _engine(model, max_num_seqs=args.decoders + 8, **kw)
    dec = SamplingParams(max_tokens=min(args.decode_tokens, engine.max_model_len - 129), temperature=0.0,
                         ignore_eos=True)
    for i in range(args.decoders):
        engine.add_request(f"d{i}", _ids(128, 100 + i), dec)
    started: set[str] = set()
    while len(started) < args.decoders:  # every decoder past its prompt
        started |= {o.request_id for o in engine.step() if o.token_ids}
    last: dict[str, float] = {}
    itl: list[float] = []
    arrivals: dict[str, float] = {}
    ttft: list[float] = []
    start = time.perf_counter()
    next_arrival, n, refill = start, 0, args.decoders
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
                last[o.request_id] = now
                if o.finished:  # keep the decoding population constant: a fresh decoder takes its place
                    refill += 1
                    engine.add_request(f"d{refill}", _ids(128, 100 + refill), dec)
            elif o.request_id in arrivals and len(o.token_ids) >= 1:
                ttft.append(now - arrivals.pop(o.request_id))
    for rid in list(engine.running_request_ids()):
        engine.abort_request(rid)
    p50, p99 = float(np.percentile(itl, 50)), float(np.percentile(itl, 99))
    return {"workload": "smooth", "mode": mode, "budget": kw["budget"], "chunk": kw.get("chunk", 0),
            "decoders": args.decoders, "arrival_len": args.arrival_len, "arrive_every_s": args.arrive_every,
            "itl_p50_ms": 1e3 * p50, "itl_p99_ms": 1e3 * p99, "p99_over_p50": p99 / p50,
            "long_prompts_arrived": n, "ttft_s": [round(t, 3) for t in ttft],
            "ttft_median_s": statistics.median(ttft) if ttft else None}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", nargs="+", default=["single", "long", "smooth"])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: random ouro-1.4b written to a temp dir)")
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--long-len", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=0, help="prefill chunk size (0: the budget)")
    ap.add_argument("--logprobs-k", type=int, default=5, help="top-k of the logprobs workload")
    ap.add_argument("--decoders", type=int, default=32)
    ap.add_argument("--arrival-len", type=int, default=16384)
    ap.add_argument("--arrive-every", type=float, default=3.0)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--num-kv-blocks", type=int, default=24000)
    ap.add_argument("--decode-tokens", type=int, default=512, help="max_tokens of each decoding request")
    ap.add_argument("--modes", nargs="+", default=["full", "chunked", "wavefront"])
    ap.add_argument("--reps", type=int, default=3)
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
                  else [logprobs(model, args)] if w == "logprobs"
                  else [smooth(model, args, m) for m in args.modes]):
            print(json.dumps(r), flush=True)
            results.append(r)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
