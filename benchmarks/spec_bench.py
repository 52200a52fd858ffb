"""Self-speculation benchmark: tokens/s against measured acceptance, speculative vs plain.

For each loop-update scale (``--scales``; see ``rlt.spec.bench_checkpoint``: smaller scale, higher
acceptance) it writes a controlled-acceptance checkpoint of the named shapes (random weights),
then runs C concurrent greedy requests of ``--out`` output tokens: once plain (the same build,
self_spec enabled, requests without speculation) and once per (K, d) in ``--ks`` x ``--ds``
(fixed K), plus adaptive K (``--adaptive``). Reports tokens/s, speedup over plain and the
measured acceptance (accepted / checked drafts, from :class:`rlt.spec.stats.SpecStats`).

H200 (the issue's acceptance run; Ouro-1.4B shapes, bf16):
    python -m benchmarks.spec_bench --model ouro-1.4b --device cuda --dtype bfloat16 --c 1 --out 256 \\
        --scales 1.0,0.1,0.03,0.01 --ks 2,4,8 --ds 1,2 --out-dir benchmarks/results/spec-h200-c1
    python -m benchmarks.spec_bench --model ouro-1.4b --device cuda --dtype bfloat16 --c 64 --out 256 \\
        --scales 1.0,0.03 --ks 4 --ds 2 --adaptive --out-dir benchmarks/results/spec-h200-c64
CPU smoke: python -m benchmarks.spec_bench --model ouro-tiny --device cpu --dtype float32 --out 32
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from benchmarks.bench_model import write_random_checkpoint
from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.composition import build_engine
from rlt.spec.bench_checkpoint import scale_loop_updates
from rlt.spec.feature import SpecOptions
from rlt.spec.stats import SpecStats


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def run(path: str, args, spec: dict | None, adaptive: bool) -> dict:
    cfg = EngineConfig(model=path, device=args.device, dtype=args.dtype, max_num_seqs=max(args.c, 1),
                       max_num_batched_tokens=args.budget)
    engine = build_engine(cfg, enabled={"self_spec": True},
                          options={"self_spec": SpecOptions(adaptive=adaptive)})
    stats = SpecStats()
    engine.add_observer(stats)
    rng = random.Random(0)
    vocab = engine.model.shape.vocab_size

    def batch(n_out: int) -> int:
        for i in range(args.c):
            prompt = [rng.randrange(3, min(vocab, 30000)) for _ in range(args.input_len)]
            engine.add_request(f"{time.monotonic_ns()}-{i}", prompt, SamplingParams(
                max_tokens=n_out, temperature=0.0, ignore_eos=True, speculation=spec))
        produced = 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    produced += len(o.token_ids)
        return produced

    batch(8)  # warm-up
    stats.rounds = stats.drafted = stats.accepted = stats.steps = 0
    engine.ctx.platform.synchronize()
    t0 = time.perf_counter()
    produced = batch(args.out)
    engine.ctx.platform.synchronize()
    dt = time.perf_counter() - t0
    return {"tokens_per_s": produced / dt, "tokens": produced, "seconds": dt, "steps": stats.steps,
            "acceptance": stats.acceptance, "rounds": stats.rounds}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.spec_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="ouro-1.4b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--c", type=int, default=1, help="concurrent requests")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--out", type=int, default=256, help="output tokens per request")
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--scales", default="1.0,0.03")
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--ds", default="1,2")
    ap.add_argument("--adaptive", action="store_true", help="also run adaptive K (K_max = max of --ks)")
    ap.add_argument("--work-dir")
    ap.add_argument("--out-dir", default="benchmarks/results/spec-latest")
    args = ap.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="spec-bench-"))
    src = write_random_checkpoint(work / "src", args.model)
    results: dict = {"args": vars(args), "runs": []}
    for scale in [float(s) for s in args.scales.split(",")]:
        path = str(scale_loop_updates(src, work / f"scale-{scale}", scale))
        plain = run(path, args, None, False)
        results["runs"].append({"scale": scale, "mode": "plain", **plain})
        print(f"scale {scale}: plain {plain['tokens_per_s']:.1f} tok/s", flush=True)
        configs = [(k, d, False) for k in _ints(args.ks) for d in _ints(args.ds)]
        if args.adaptive:
            configs += [(max(_ints(args.ks)), d, True) for d in _ints(args.ds)]
        for k, d, adaptive in configs:
            r = run(path, args, {"num_tokens": k, "draft_loops": d}, adaptive)
            r.update(scale=scale, mode="adaptive" if adaptive else "fixed", k=k, d=d,
                     speedup=r["tokens_per_s"] / plain["tokens_per_s"])
            results["runs"].append(r)
            print(f"scale {scale} K={k} d={d} {r['mode']}: {r['tokens_per_s']:.1f} tok/s "
                  f"x{r['speedup']:.2f} acceptance {r['acceptance']:.3f}", flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec_bench.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
