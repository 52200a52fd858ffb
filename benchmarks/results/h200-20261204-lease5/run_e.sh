#!/usr/bin/env bash
# Lease 5, call E (right after D; .whl/fa4b carried now): FA4 installed; the FA4 prompt-row test again
# (the rope warp-count fix), single 8K prefill with FA4 for prompt rows, its profile with a trace.
set -u
R=/tmp/re; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-serve/src:packages/rlt-decode/src:packages/rlt-kvcache/src:packages/rlt-spec/src:packages/rlt-prefill/src:apps/server/src:.
PY=python3
pack() { tar czf "$OUT/re.tgz" -C /tmp re; echo "== $(date +%T) $1 done"; }
. scripts/install_carried_wheels.sh .whl/fa4a .whl/fa4b
$PY -c "import flash_attn.cute; print('fa4 ok')" 2>&1 | tail -1
timeout 150 $PY -m pytest tests/gpu/test_prefill_gpu.py tests/gpu/test_flash_gpu.py -m gpu -q -p no:cacheprovider -o addopts="" -rfE -s \
  -k "fa4 or fixed_depth" > $R/fa4-tests.txt 2>&1
grep -E "passed|failed|fa4 prompt rows|FAIL|Error" $R/fa4-tests.txt | tail -6; pack tests
timeout 150 $PY -m benchmarks.prefill_bench --workload single profile --reps 3 --trace $R/trace.json --out $R/prefill8k-fa4.json > $R/prefill8k-fa4.log 2>&1
gzip -f $R/trace.json
grep '^{' $R/prefill8k-fa4.log | $PY -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); r.pop('top_kernels_ms', None); print(json.dumps(r)[:1500])"
pack prefill
