#!/usr/bin/env bash
# Lease 7, call a: split-K o_proj / down_proj (micro-benchmark with a plan sweep), then rlt-decode
# end to end with and without split-K (same build, back to back), then the fused-op GPU tests.
set -uo pipefail
R=${OUT:?}/a
mkdir -p "$R"
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-decode/src:apps/server/src:.
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" > "$R/versions.txt" 2>&1
git rev-parse HEAD >> "$R/versions.txt" 2>/dev/null
timeout 120 python3 -m pytest tests/gpu/test_fused_ops_gpu.py -q -p no:cacheprovider -o addopts="" -rA > "$R/fused-tests.log" 2>&1
tail -2 "$R/fused-tests.log"
KERNELS=1 KERNELS_TIMEOUT=${KT:-230} KERNEL_ARGS="--parts linear --shapes o_proj,down_proj --rows 1,2,4,8,16,32,64 --sweep-rows 1,16,64" \
  SKIP_TESTS=1 VARIANTS="nosplit decode" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=110 OUT=$R bash scripts/decode_h200.sh
