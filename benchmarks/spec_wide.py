"""Wide chains against plain chains (issue 13, docs/spec.md "Wide chains"): C = 1 decode tokens/s
of overlapped self-speculation at d = 2, K = 8 with ``--self-spec-width`` 1 (a plain chain) and W
(the newest position runs the draft's W best tokens), on the benchmark checkpoint at given loop
scales, against plain decoding of the same build (rlt-decode's graphs and pipeline).

Reports per scale and width: decode tokens/s (median of ``--reps`` after a warm-up), the speedup
over plain decoding, the per-check acceptance (a wide check accepts when the full-depth token is
any candidate's), steps per token and ms per step — so the step model's bound and the cost of the
wider steps are both visible.

GPU (one device call, ~3-4 min):
    python -m benchmarks.spec_wide --scales 0.01,0.02 --widths 1,4 --out-dir "$OUT/wide"
CPU (ouro-tiny, the same logic):
    python -m benchmarks.spec_wide --preset cpu --scales 0.2 --out-dir /tmp/spec-wide
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from benchmarks.bench_model import write_random_checkpoint
from benchmarks.spec_bench import Bench, ScaledLoader, _floats, _ints, decode_features, log, parse_args
from rlt.platform.platforms import detect_platform


def main(argv=None) -> dict:
    def extra(ap):
        ap.add_argument("--widths", default="1,4", help="--self-spec-width values to compare (1: plain chains)")
        ap.add_argument("--k", type=int, default=8)
        ap.add_argument("--d", type=int, default=2)

    args = parse_args(argv, prog="python -m benchmarks.spec_wide", description=__doc__, extra=extra)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="spec-wide-"))
    t0 = time.perf_counter()
    src = write_random_checkpoint(work / "src", args.model)
    bench = Bench(args, src, ScaledLoader(), decode_features(), detect_platform(args.device))
    spec = {"num_tokens": args.k, "draft_loops": args.d}
    res: dict = {"args": vars(args), "runs": []}

    engine = bench.engine(1.0)
    bench.warm(engine, 1, {"num_tokens": 2, "draft_loops": 1})
    plain = bench.measure(engine, 1, args.out, None)
    res["plain"] = plain
    log(f"plain: {plain['decode_tokens_per_s']:.1f} tok/s, {plain['ms_per_step']:.3f} ms/step")
    engine = None
    for scale in _floats(args.scales):
        for width in _ints(args.widths):
            engine = bench.engine(scale, overlap=True, options={"width": width})
            bench.warm(engine, 1, spec)
            r = bench.measure(engine, 1, args.out, spec)
            engine = None
            r.update(scale=scale, width=width, speedup=r["decode_tokens_per_s"] / plain["decode_tokens_per_s"],
                     step_cost=r["ms_per_step"] / plain["ms_per_step"])
            res["runs"].append(r)
            log(f"scale {scale} width {width}: {r['decode_tokens_per_s']:.1f} tok/s x{r['speedup']:.2f}  "
                f"a={r['acceptance']:.3f}  steps/token {r['steps_per_token']:.2f}  {r['ms_per_step']:.3f} ms/step "
                f"({r['step_cost']:.3f}x plain)")
            (out_dir / "spec_wide.json").write_text(json.dumps(res, indent=1, default=str))
    res["seconds"] = time.perf_counter() - t0
    (out_dir / "spec_wide.json").write_text(json.dumps(res, indent=1, default=str))
    print(f"\nplain {plain['decode_tokens_per_s']:.1f} tok/s ({plain['ms_per_step']:.3f} ms/step); "
          f"K = {args.k}, d = {args.d}, C = 1, {args.out} tokens")
    print("| scale | width | acceptance | tok/s | x plain | steps/token | ms/step (x plain) |")
    print("|---|---|---|---|---|---|---|")
    for r in res["runs"]:
        print(f"| {r['scale']} | {r['width']} | {r['acceptance']:.3f} | {r['decode_tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f} | {r['steps_per_token']:.2f} | {r['ms_per_step']:.3f} ({r['step_cost']:.3f}) |")
    print(f"total {res['seconds']:.0f} s")
    return res


if __name__ == "__main__":
    main()
