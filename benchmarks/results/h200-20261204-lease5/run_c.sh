#!/usr/bin/env bash
# Lease 5, call C (right after B: .whl/fa4a is still on the machine, .whl/fa4b carried now): FA4 installed
# from the two halves; the FA4 GPU tests (prompt rows under adaptive exit vs Triton, engine vs Triton);
# single 8K prefill on the default path with FA4 for prompt rows, and its profile with idle gaps.
set -u
R=/tmp/rc; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-serve/src:packages/rlt-decode/src:packages/rlt-kvcache/src:packages/rlt-spec/src:packages/rlt-prefill/src:apps/server/src:.
PY=python3
pack() { tar czf "$OUT/rc.tgz" -C /tmp rc; echo "== $(date +%T) $1 done"; }
ls .whl/fa4a .whl/fa4b
. scripts/install_carried_wheels.sh .whl/fa4a .whl/fa4b
$PY -c "import flash_attn.cute as c; print('fa4 ok')" 2>&1 | tail -1
timeout 200 $PY -m pytest tests/gpu/test_prefill_gpu.py tests/gpu/test_flash_gpu.py -m gpu -q -p no:cacheprovider -o addopts="" -rfEs -s \
  -k "fa4 or flash or fixed_depth" > $R/fa4-tests.txt 2>&1
grep -E "passed|failed|fa4 prompt rows|SKIP|FAIL|Error" $R/fa4-tests.txt | tail -8; pack tests
timeout 150 $PY -m benchmarks.prefill_bench --workload single profile --reps 3 --out $R/prefill8k-fa4.json > $R/prefill8k-fa4.log 2>&1
grep -v Warn $R/prefill8k-fa4.log | grep '^{' | cut -c1-2500; pack prefill
