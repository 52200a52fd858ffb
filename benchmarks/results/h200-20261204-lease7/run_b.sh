#!/usr/bin/env bash
# Lease 7, call b: split-K with the measured plan rule (MIN_SPLIT_K, up to 64 rows) end to end against
# RLT_SPLIT_K=0 (same build, back to back: C=1, C=64 decode and C=128 1K/128 end to end), then the 8K
# prefill's host time (Triton attention: where the TTFT beyond the kernels goes).
set -uo pipefail
R=${OUT:?}/b
mkdir -p "$R"
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-decode/src:packages/rlt-prefill/src:apps/server/src:.
git rev-parse HEAD > "$R/versions.txt" 2>/dev/null
timeout 100 python3 -m pytest tests/gpu/test_fused_ops_gpu.py -q -p no:cacheprovider -o addopts="" -k split_k > "$R/fused-tests.log" 2>&1
tail -1 "$R/fused-tests.log"
SKIP_TESTS=1 VARIANTS="nosplit decode" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=170 \
  EXTRA_WORKLOADS="--workload c=128,in=1024,out=128,req=128,budget=35,name=c128-1k" OUT=$R bash scripts/decode_h200.sh
timeout 120 python3 -m benchmarks.prefill_bench --workload single profile --reps 3 > "$R/prefill8k.log" 2>&1
grep '^{' "$R/prefill8k.log" | cut -c1-900
