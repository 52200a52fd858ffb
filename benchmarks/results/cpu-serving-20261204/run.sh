#!/usr/bin/env bash
# Serving vs offline on the demo model, the commands of ../cpu-serving-20261203/README.md, at torch's
# default threads (t2) and with OMP_NUM_THREADS=1 (t1) for server and offline alike.
# Run from the repo root with the rlt venv active:
#   [D=benchmarks/results/cpu-serving-20261204/runK] bash benchmarks/results/cpu-serving-20261204/run.sh
set -euo pipefail
D=${D:-benchmarks/results/cpu-serving-20261204}
PORT=${PORT:-8631}
BASE=http://127.0.0.1:$PORT
SB=(python benchmarks/serve_bench.py --base-url "$BASE" --num-prompts 64 --max-concurrency 64
    --input-len 57 --output-len 64 --ignore-eos)

one_setting() {  # tag, then the environment for server and offline
    local tag=$1; shift
    env "$@" rlt-server serve --port "$PORT" > "$D/server_$tag.log" 2>&1 &
    local server=$!
    for _ in $(seq 120); do curl -sf "$BASE/health" >/dev/null && break; sleep 1; done
    "${SB[@]}" --num-prompts 2 --max-concurrency 1 > /dev/null          # 2 warm-up requests
    for i in 1 2 3; do echo "$tag s$i: $(uptime); pytest processes $(pgrep -fc pytest || true)" >> "$D/load.txt"; "${SB[@]}" --result-file "$D/${tag}_s$i.json" > /dev/null; done
    for i in 1 2 3; do echo "$tag n$i: $(uptime); pytest processes $(pgrep -fc pytest || true)" >> "$D/load.txt"; "${SB[@]}" --no-stream --result-file "$D/${tag}_n$i.json" > /dev/null; done
    kill "$server"; wait "$server" || true
    echo "$tag off: $(uptime); pytest processes $(pgrep -fc pytest || true)" >> "$D/load.txt"
    env "$@" python -m benchmarks.offline_same_prompts --num-prompts 64 --input-len 57 --output-len 64 \
        --ignore-eos --reps 3 --result-file "$D/${tag}_off.json" > /dev/null
}
one_setting t2
one_setting t1 OMP_NUM_THREADS=1
echo "end: $(uptime); pytest processes $(pgrep -fc pytest || true)" >> "$D/load.txt"
python - "$D" <<'PY'
import json, statistics, sys
from pathlib import Path
d = Path(sys.argv[1])
for tag in ("t2", "t1"):
    off = json.loads((d / f"{tag}_off.json").read_text())
    print(tag, "offline", [round(r["output_throughput"]) for r in off["runs"]], "median",
          round(off["output_throughput_median"]))
    for kind in ("s", "n"):
        runs = [json.loads((d / f"{tag}_{kind}{i}.json").read_text()) for i in (1, 2, 3)]
        tput = [round(r["output_throughput"]) for r in runs]
        print(tag, kind, tput, "median", statistics.median(tput),
              "ttft p50", [round(r["ttft_ms"]["p50"]) for r in runs],
              "tpot p50", [round(r["tpot_ms"]["p50"], 1) for r in runs] if kind == "s" else "")
PY
