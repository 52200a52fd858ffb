#!/usr/bin/env bash
# Lease 7, call d (right after c, which carried .whl/fa4a): FA4 from both halves; FA4 GPU tests;
# 8K prefill with FA4 for prompt rows on the default path (median of 3 after a warm-up) + profile.
set -u
R=${OUT:?}/d; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-serve/src:packages/rlt-decode/src:packages/rlt-kvcache/src:packages/rlt-spec/src:packages/rlt-prefill/src:apps/server/src:.
ls .whl/fa4a | head -3
. scripts/install_carried_wheels.sh .whl/fa4a .whl/fa4b
python3 -c "import flash_attn.cute; print('fa4 ok')" 2>&1 | tail -1
timeout 150 python3 -m pytest tests/gpu/test_prefill_gpu.py tests/gpu/test_flash_gpu.py -m gpu -q -p no:cacheprovider -o addopts="" -rfE -s \
  -k "fa4 or fixed_depth" > $R/fa4-tests.txt 2>&1
grep -E "passed|failed|FAIL" $R/fa4-tests.txt | tail -4
for i in 1 2; do
  timeout 120 python3 -m benchmarks.prefill_bench --workload single profile --reps 3 --out $R/prefill8k-fa4-$i.json > $R/prefill8k-fa4-$i.log 2>&1
  grep '^{' $R/prefill8k-fa4-$i.log | cut -c1-420
done
