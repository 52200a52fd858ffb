#!/usr/bin/env bash
# Lease 7, call e: programmatic dependent launch of the decode kernels (rlt.attention.pdl): GPU tests of
# the decode path (PDL on by default; one test compares PDL on/off bit for bit), then rlt-decode end to
# end with PDL off and on (same build, back to back: C=1, C=64 decode).
set -uo pipefail
R=${OUT:?}/${CALL:-e}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-serve/src:packages/rlt-decode/src:packages/rlt-kvcache/src:packages/rlt-spec/src:packages/rlt-prefill/src:apps/server/src:.
timeout 200 python3 -m pytest tests/gpu/test_decode_gpu.py tests/gpu/test_fused_ops_gpu.py tests/gpu/test_triton_attention_gpu.py \
  tests/gpu/test_engine_gpu.py -m gpu -q -p no:cacheprovider -o addopts="" -rfE -x > "$R/gpu-tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|Error" "$R/gpu-tests.log" | tail -8
SKIP_TESTS=1 VARIANTS="${VARIANTS:-nopdl decode}" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=110 OUT=$R bash scripts/decode_h200.sh
