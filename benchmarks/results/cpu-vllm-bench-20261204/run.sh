#!/usr/bin/env bash
# vllm bench serve (both OpenAI backends) and benchmarks/serve_bench.py against rlt-server serve
# (demo model) on loopback, same workload, alternating, $ROUNDS rounds. Run from the repo root with
# the rlt venv active (ROUNDS=3 by default); VLLM points at a vllm install in a separate venv (never the project's).
# Usage: VLLM=/tmp/vllm-venv/bin/vllm bash benchmarks/results/cpu-vllm-bench-20261204/run.sh
set -euo pipefail
D=${D:-benchmarks/results/cpu-vllm-bench-20261204}
VLLM=${VLLM:-vllm}
PORT=${PORT:-8741}
BASE=http://127.0.0.1:$PORT
TOK=$HOME/.cache/rlt/demo-ouro-tiny-v2
N=${N:-64}; IN=128; OUT=64; WORDS=58   # 58 random words ~ 127 demo-tokenizer tokens (serve_bench's prompts)

rlt-server serve --port "$PORT" > "$D/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "$BASE/health" >/dev/null && break; sleep 1; done
# two warm-up requests
python benchmarks/serve_bench.py --base-url "$BASE" --num-prompts 2 --max-concurrency 1 --input-len $WORDS \
    --output-len 8 --ignore-eos > /dev/null

vllm_run() {  # backend endpoint name
    echo "  $3: load $(cut -d" " -f1-3 /proc/loadavg), pytest processes $(pgrep -fc pytest || true)" >> "$D/load.txt"
    "$VLLM" bench serve --backend "$1" --base-url "$BASE" --endpoint "$2" \
        --model demo-ouro-tiny-v2 --tokenizer "$TOK" \
        --dataset-name random --random-input-len $IN --random-output-len $OUT --num-prompts $N \
        --request-rate inf --ignore-eos --temperature 0 --seed 0 --disable-tqdm \
        --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,95,99 \
        --save-result --save-detailed --result-dir "$D" --result-filename "$3.json" > "$D/$3.txt" 2>&1
}
sb_run() {  # endpoint name
    echo "  $2: load $(cut -d" " -f1-3 /proc/loadavg), pytest processes $(pgrep -fc pytest || true)" >> "$D/load.txt"
    python benchmarks/serve_bench.py --base-url "$BASE" --endpoint "$1" --model demo-ouro-tiny-v2 \
        --num-prompts $N --request-rate inf --input-len $WORDS --output-len $OUT --ignore-eos --temperature 0 \
        --seed 0 --label serve_bench --result-file "$D/$2.json" > "$D/$2.txt" 2>&1
}
for r in $(seq "${ROUNDS:-3}"); do
    echo "round $r: $(uptime); other pytest processes: $(pgrep -fc pytest || true)" | tee -a "$D/load.txt"
    vllm_run vllm /v1/completions "vllm_cmpl_$r"
    sb_run /v1/completions "sb_cmpl_$r"
    vllm_run openai-chat /v1/chat/completions "vllm_chat_$r"
    sb_run /v1/chat/completions "sb_chat_$r"
done
echo "end: $(uptime)" | tee -a "$D/load.txt"
