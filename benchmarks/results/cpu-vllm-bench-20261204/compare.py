"""The comparison table of README.md: per client and endpoint, the median over the rounds of each
metric (vllm bench serve's result JSON vs serve_bench's), from the files beside this script.
Usage: python benchmarks/results/cpu-vllm-bench-20261204/compare.py [DIR]"""
import json
import statistics
import sys
from pathlib import Path

d = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent


def vllm_row(r):
    return {"ok": r["completed"], "failed": r["failed"], "in": r["total_input_tokens"], "out": r["total_output_tokens"],
            "out_tps": r["output_throughput"],
            **{f"{m}_{s}": r[f"{'median' if s == 'p50' else s}_{m}_ms"] for m in ("ttft", "tpot", "itl", "e2el")
               for s in ("mean", "p50", "p99")}}


def sb_row(r):
    return {"ok": r["completed"], "failed": r["failed"], "in": r["total_input_tokens"], "out": r["total_output_tokens"],
            "out_tps": r["output_throughput"],
            **{f"{m}_{s}": r[f"{m}_ms"][s] for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "p50", "p99")}}


cols = ["ok", "failed", "in", "out", "out_tps", "ttft_p50", "ttft_p99", "tpot_mean", "tpot_p50", "itl_mean",
        "itl_p50", "itl_p99", "e2el_p50"]
print("| client | endpoint | " + " | ".join(cols) + " |")
print("|---" * (len(cols) + 2) + "|")
for ep in ("cmpl", "chat"):
    for name, row in (("vllm", vllm_row), ("sb", sb_row)):
        runs = [row(json.loads(f.read_text())) for f in sorted(d.glob(f"{name}_{ep}_[0-9]*.json"))]
        med = {c: statistics.median(r[c] for r in runs) for c in cols}
        client = "vllm bench serve" if name == "vllm" else "serve_bench"
        print(f"| {client} | {ep} | " + " | ".join(f"{med[c]:.0f}" if c in ("ok", "failed", "in", "out", "out_tps")
                                                   else f"{med[c]:.1f}" for c in cols) + " |")
