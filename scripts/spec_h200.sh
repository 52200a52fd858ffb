#!/usr/bin/env bash
# rlt-spec on the H200 in one device call (about 9 minutes): the GPU tests of self-speculation
# (fp32 greedy token identity with plain decoding for K 1..8 x d 1..3, eager and through rlt-decode's
# static buffers and graphs; the bf16 agreement report), then the speculation benchmark
# (benchmarks/spec_bench.py: tokens/s against acceptance at C = 1, sync and overlapped, against the
# eager and the default build's plain decoding; the measured cost of a speculative step in plain
# steps, which --self-spec-step-cost's default estimates):
#
#   OUT=benchmarks/results/<dir> bash scripts/spec_h200.sh
# SKIP_TESTS=1 (benchmark only), BENCH_ARGS (e.g. "--scales 0.001,0.0003 --ks 2,4 --ds 1,2 --big-c 0").
set -uo pipefail
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-decode/src:packages/rlt-spec/src:packages/rlt-kvcache/src:apps/server/src:.${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  $PY -c 'from benchmarks.report import source_fingerprint as f; print("source", f())'; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${SUITE_TIMEOUT:-200} $PY -m pytest tests/gpu/test_spec_gpu.py -m gpu -q -p no:cacheprovider -o addopts="" -rA -s \
    > "$OUT/gpu-tests.log" 2>&1
  grep -E "bf16 greedy agreement|passed|failed" "$OUT/gpu-tests.log" | tail -8
fi
timeout ${BENCH_TIMEOUT:-360} $PY -m benchmarks.spec_bench --preset h200 --out-dir "$OUT/spec" ${BENCH_ARGS:-} \
  > "$OUT/spec.log" 2>&1
tail -40 "$OUT/spec.log"
