#!/usr/bin/env bash
# Serving vs offline on the H200 in one device call (issue 10, "Serving on the H200"):
# a random-weight Ouro-1.4B-shapes checkpoint (bf16, benchmarks/bench_model.py's writer), `rlt-server serve`
# on loopback (Triton attention, rlt-decode features on), benchmarks/serve_bench.py at C=1, 64, 128 with
# ~1K-token prompts / 128 output tokens (requests = C, C=1: 2), then the server stopped and
# benchmarks/offline_bench.py on the same workloads with the server's engine settings (rlt-decode's
# features, the default step budget of 8,192 tokens), and a comparison table in $OUT/comparison.md.
#
#   OUT=benchmarks/results/<dir> bash scripts/serve_h200.sh            # on the H200 (wheels: .whl/serve)
#   OUT=/tmp/sh PRESET=cpu-tiny PYTHON=python bash scripts/serve_h200.sh  # the logic on CPU, demo-sized model
# CONCS, SERVE_FLAGS (extra server flags, e.g. --no-pipeline), FAST=1 (install uvloop + httptools from
# .whl/fast first: uvicorn picks them up), SKIP_OFFLINE=1 (serve side only). The server warms up before it
# listens (--warmup auto: on for a GPU); SERVE_FLAGS="--warmup off" measures without.
set -uo pipefail
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=${TORCH_DEVICE_BACKEND_AUTOLOAD:-0}
PY=${PYTHON:-python3}
PORT=${PORT:-8011}
PRESET=${PRESET:-h200}
if [ "$PRESET" = cpu-tiny ]; then
  MODEL=ouro-tiny; DTYPE=float32; ATTN=torch; DEVFLAGS=(); OFFLINE_FEATURES=()
  CONCS=${CONCS:-"1 4"}; WORDS=${WORDS:-20}; OUTLEN=${OUTLEN:-8}; BUDGET=20
else
  MODEL=ouro-1.4b; DTYPE=bfloat16; ATTN=triton; DEVFLAGS=(--static-buffers --graphs)
  OFFLINE_FEATURES=(--feature-module rlt.decode.feature)
  CONCS=${CONCS:-"1 64 128"}; WORDS=${WORDS:-330}; OUTLEN=${OUTLEN:-128}; BUDGET=40
fi
if [ "${FAST:-0}" = 1 ] && [ -d .whl/fast ]; then   # uvicorn's fast loop and parser (uvicorn[standard]: uvloop, httptools)
  $PY -m pip install -q --no-index --find-links .whl/fast uvloop httptools
fi
if [ -d .whl/serve ]; then   # the device has no network: install the carried wheels (device-recipes.md)
  $PY -m pip install -q --no-index --find-links .whl/serve fastapi uvicorn prometheus-client httpx pydantic hatchling editables
  $PY -m pip install -q --no-index --find-links .whl/serve --no-deps -e packages/rlt-attention -e packages/rlt-platform \
    -e packages/rlt-serve -e packages/rlt-decode -e apps/server
fi
CK=${CK:-/tmp/rlt-serve-ck-$MODEL}
timeout 300 $PY -c "from benchmarks.bench_model import write_random_checkpoint as w; w('$CK', '$MODEL')" || { echo "checkpoint write failed"; exit 1; }

SERVER_PID=
stop_server() { if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then kill -TERM "$SERVER_PID"; for _ in $(seq 20); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done; kill -KILL "$SERVER_PID" 2>/dev/null; fi; SERVER_PID=; }
trap stop_server EXIT INT TERM
$PY -m rlt_server.cli serve --model "$CK" --dtype "$DTYPE" --attention-backend "$ATTN" --port "$PORT" \
  --max-num-seqs 128 --max-model-len 2048 "${DEVFLAGS[@]}" ${SERVE_FLAGS:-} > "$OUT/server.log" 2>&1 &
SERVER_PID=$!
ok=0
for _ in $(seq ${HEALTH_WAIT:-240}); do
  if $PY -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health', timeout=2).status_code != 200)" 2>/dev/null; then ok=1; break; fi
  kill -0 "$SERVER_PID" 2>/dev/null || break
  sleep 1
done
if [ $ok != 1 ]; then echo "server did not become healthy"; tail -30 "$OUT/server.log"; exit 1; fi
$PY -c "import httpx; print(httpx.get('http://127.0.0.1:$PORT/v1/engine').text)" > "$OUT/engine.json"
WL=()
SEEN=" "
for c in $CONCS; do   # a C listed twice runs twice (the second's files: serve-c<C>-r2.*), offline once
  req=$c; [ "$c" = 1 ] && req=2
  tag=c$c; [[ $SEEN == *" $c "* ]] && tag=c$c-r2
  timeout ${BENCH_TIMEOUT:-150} $PY benchmarks/serve_bench.py --base-url "http://127.0.0.1:$PORT" --num-prompts "$req" \
    --max-concurrency "$c" --input-len "$WORDS" --output-len "$OUTLEN" --ignore-eos --num-warmups 2 \
    --percentiles 50,99 --result-file "$OUT/serve-$tag.json" > "$OUT/serve-$tag.log" 2>&1 || echo "serve_bench C=$c failed (see serve-$tag.log)"
  # the engine's own counters after the run (steps, graph replays, pipeline sync reasons / drains) and /metrics
  $PY -c "import httpx; print(httpx.get('http://127.0.0.1:$PORT/v1/engine').text)" > "$OUT/engine-after-$tag.json" 2>/dev/null
  $PY -c "import httpx; print(httpx.get('http://127.0.0.1:$PORT/metrics').text)" > "$OUT/metrics-after-$tag.txt" 2>/dev/null
  [[ $SEEN == *" $c "* ]] || WL+=(--workload "c=$c,in=$($PY -c "import json;d=json.load(open('$OUT/serve-c$c.json'));print(max(1,d['total_input_tokens']//max(1,d['completed'])))" 2>/dev/null || echo 1024),out=$OUTLEN,req=$req,budget=$BUDGET,name=c$c")
  SEEN="$SEEN$c "
done
stop_server
[ "${SKIP_OFFLINE:-0}" = 1 ] || timeout ${OFFLINE_TIMEOUT:-240} $PY -m benchmarks.offline_bench --model "$CK" --dtype "$DTYPE" --attention-backend "$ATTN" \
  --out-dir "$OUT/offline" --reps 3 --warmup-output-len 4 --max-num-batched-tokens 8192 "${OFFLINE_FEATURES[@]}" "${WL[@]}" > "$OUT/offline.log" 2>&1 \
  || echo "offline_bench failed (see offline.log)"
$PY - "$OUT" $CONCS <<'PY'
import json, sys
from pathlib import Path
out, concs = Path(sys.argv[1]), list(dict.fromkeys(sys.argv[2:]))
concs += [f"{c}-r2" for c in concs if (out / f"serve-c{c}-r2.json").exists()]
try:
    results = json.loads((out / "offline" / "results.json").read_text())
    offline = {w["workload"]["name"]: w["median"] for w in results["workloads"]}
except (OSError, ValueError, KeyError, TypeError):
    offline = {}
lines = ["| C | serve out tok/s | offline e2e tok/s | ratio | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms |",
         "|---|---|---|---|---|---|---|"]
for c in concs:
    try:
        s = json.loads((out / f"serve-c{c}.json").read_text())
    except (OSError, ValueError):
        lines.append(f"| {c} | failed | | | | | |"); continue
    off = (offline.get(f"c{c.split('-')[0]}") or {}).get("e2e_tok_s")
    ratio = f"{s['output_throughput'] / off:.2f}" if off else "n/a"
    f = lambda k: f"{s[k]['p50']:.1f} / {s[k]['p99']:.1f}"
    lines.append(f"| {c} | {s['output_throughput']:.1f} | {off and f'{off:.1f}'} | {ratio} | {f('ttft_ms')} | {f('tpot_ms')} | {f('itl_ms')} |")
(out / "comparison.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
