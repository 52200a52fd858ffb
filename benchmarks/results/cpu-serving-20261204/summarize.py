"""The tables of README.md from run*/ (each a full run.sh run): per thread setting, output tok/s of
streaming (s) / non-streaming (n) serving and offline LLM.generate, per run the median of its 3
and the ratio to that run's offline median, and the median over all runs' 9 values.
Usage: python benchmarks/results/cpu-serving-20261204/summarize.py [DIR]"""
import json
import statistics
import sys
from pathlib import Path

d = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
runs = sorted(p for p in d.glob("run*") if p.is_dir())
print("| threads | path | " + " | ".join(f"{r.name}: tok/s (vs offline)" for r in runs) + " | all runs: median tok/s | vs offline | TTFT p50 ms | TPOT p50 ms |")
print("|---" * (len(runs) + 6) + "|")
for tag in ("t2", "t1"):
    off_all = [x["output_throughput"] for r in runs for x in json.loads((r / f"{tag}_off.json").read_text())["runs"]]
    off_med = statistics.median(off_all)
    for kind, label in (("s", "serve, streaming"), ("n", "serve, non-streaming"), ("off", "`LLM.generate`")):
        cells, vals, ttft, tpot = [], [], [], []
        for r in runs:
            off = statistics.median(x["output_throughput"] for x in json.loads((r / f"{tag}_off.json").read_text())["runs"])
            if kind == "off":
                v = off
                vals += [x["output_throughput"] for x in json.loads((r / f"{tag}_off.json").read_text())["runs"]]
                cells.append(f"{v:.0f}")
                continue
            res = [json.loads((r / f"{tag}_{kind}{i}.json").read_text()) for i in (1, 2, 3)]
            v = statistics.median(x["output_throughput"] for x in res)
            vals += [x["output_throughput"] for x in res]
            ttft += [x["ttft_ms"]["p50"] for x in res]
            if kind == "s":
                tpot += [x["tpot_ms"]["p50"] for x in res]
            cells.append(f"{v:.0f} ({v / off:.2f})")
        med = statistics.median(vals)
        print(f"| {tag[1]} | {label} | " + " | ".join(cells) + f" | {med:.0f} ({min(vals):.0f}-{max(vals):.0f}) | {med / off_med:.2f} | "
              + (f"{statistics.median(ttft):.0f}" if ttft else "") + " | " + (f"{statistics.median(tpot):.1f}" if tpot else "") + " |")
