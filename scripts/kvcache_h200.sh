#!/usr/bin/env bash
# rlt-kvcache on the H200: its GPU tests, its CPU tests run on CUDA, and the three benchmarks of
# issue 12 (Ouro-1.4B shapes, random weights, bf16, Triton attention):
#   OUT=benchmarks/results/h200-kvcache bash scripts/kvcache_h200.sh
set -uo pipefail
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-kvcache/src:packages/rlt-serve/src:apps/server/src:.
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/versions.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/versions.txt"
timeout ${TEST_TIMEOUT:-200} $PY -m pytest tests/gpu/test_kvcache_gpu.py tests/rlt-kvcache -q -p no:cacheprovider -o addopts="" \
  -x 2>&1 | tail -15 | tee "$OUT/tests.txt"
timeout ${BENCH_TIMEOUT:-360} $PY -m benchmarks.kvcache_bench --model ouro-1.4b --dtype bfloat16 \
  --attention-backend triton --work-dir /tmp/rlt-kvb --out-dir "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -45
