#!/usr/bin/env bash
# Lease 7, call c (carries .whl/fa4a for call d): the whole GPU suite on the split-K build (FA4 tests
# skip here: FA4 is installed in call d), every feature package on the path.
set -uo pipefail
R=${OUT:?}/c
mkdir -p "$R"
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-serve/src:packages/rlt-decode/src:packages/rlt-kvcache/src:packages/rlt-spec/src:packages/rlt-prefill/src:apps/server/src:.
timeout ${SUITE_TIMEOUT:-520} python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider -o addopts="" -rfEs \
  --durations=15 > "$R/gpu-suite.log" 2>&1
echo "rc $?"
grep -E "^(FAILED|ERROR)|passed|failed" "$R/gpu-suite.log" | tail -25
