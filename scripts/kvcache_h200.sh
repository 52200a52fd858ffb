#!/usr/bin/env bash
# rlt-kvcache on the H200 in one device call (~4-5 min expected; capped at 100 + 60 + 300 s): its GPU
# tests, its CPU tests (and the prefill composition test) on the device's cores, then the three
# benchmarks of issue 12 — (a) incremental vs full reservation, (b) prefix cache TTFT (hot and
# cold bursts), (c) priority vs fcfs — on Ouro-1.4B shapes, random weights, bf16, Triton attention.
# Each benchmark engine is freed (and its KV pool checked gone) before the next is built.
#
#   OUT=benchmarks/results/h200-kvcache bash scripts/kvcache_h200.sh
#
# Writes $OUT/versions.txt, $OUT/tests.txt, $OUT/bench.log, $OUT/results.{json,md} (results are
# rewritten after each benchmark, so a timeout keeps what finished) and prints results.md last.
# CPU check of the same logic (GPU tests skip; tiny model, workload shapes scaled down):
#   OUT=/tmp/kvh MODEL=ouro-tiny DTYPE=float32 BACKEND=auto PRESET=cpu-shape bash scripts/kvcache_h200.sh
set -uo pipefail
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-kvcache/src:packages/rlt-prefill/src:packages/rlt-decode/src:packages/rlt-serve/src:apps/server/src:.${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
MODEL=${MODEL:-ouro-1.4b}
DTYPE=${DTYPE:-bfloat16}
BACKEND=${BACKEND:-triton}
PRESET=${PRESET:-h200}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/versions.txt"
rc=0
# shellcheck disable=SC2086
timeout ${TEST_TIMEOUT:-100} $PY -m pytest tests/gpu/test_kvcache_gpu.py -m gpu -q -p no:cacheprovider -o addopts="" -rfEs \
  > "$OUT/tests.txt" 2>&1 || rc=1
tail -4 "$OUT/tests.txt"
# the CPU tests on the host's cores (hidden GPU: no Triton JIT of dozens of tiny shapes)
# shellcheck disable=SC2086
CUDA_VISIBLE_DEVICES="" timeout ${CPU_TEST_TIMEOUT:-60} $PY -m pytest tests/rlt-kvcache tests/integration/test_kvcache_prefill_compose.py \
  -q -p no:cacheprovider -o addopts="" -m "not gpu" -rfEs >> "$OUT/tests.txt" 2>&1 || rc=1
tail -2 "$OUT/tests.txt"
# shellcheck disable=SC2086
timeout ${BENCH_TIMEOUT:-300} $PY -m benchmarks.kvcache_bench --model "$MODEL" --dtype "$DTYPE" --preset "$PRESET" \
  --attention-backend "$BACKEND" --work-dir /tmp/rlt-kvb --out-dir "$OUT" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1 || rc=1
grep -E '^\((a|b|c)\)|engine freed|Error|error' "$OUT/bench.log" | tail -20
echo "== $OUT/results.md"
cat "$OUT/results.md" 2>/dev/null || { echo "no results.md; the end of bench.log:"; tail -30 "$OUT/bench.log"; }
exit $rc
