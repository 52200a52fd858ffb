#!/usr/bin/env bash
# Lease 5, call F2 (right after F1, which only carried .whl/fa4a): FA4 from both halves; the FA4
# prompt-row GPU test after the rope warp fix; 8K prefill with FA4 for prompt rows, profile + trace.
# If FA4 is not there (the machine was released between the calls): the smooth chunked run again
# (the harness now runs the engine warm-up first).
set -u
R=/tmp/rf; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-serve/src:packages/rlt-decode/src:packages/rlt-kvcache/src:packages/rlt-spec/src:packages/rlt-prefill/src:apps/server/src:.
PY=python3
pack() { tar czf "$OUT/rf.tgz" -C /tmp rf; echo "== $(date +%T) $1 done"; }
$PY -c 'from benchmarks.report import source_fingerprint as f; print("source", f())' > $R/versions.txt 2>&1; cat $R/versions.txt
if [ -e .whl/fa4a/cu13.tar.xz.part-aa ]; then
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
    r=json.loads(l); r.pop('top_kernels_ms', None); print(json.dumps(r)[:1200])"
  pack prefill
else
  echo "no fa4a here: the machine was released between the calls"
  timeout 200 $PY -m benchmarks.prefill_bench --workload smooth --modes chunked --duration 15 --out $R/smooth.json > $R/smooth.log 2>&1
  $PY -c "
import json
for r in json.load(open('/tmp/rf/smooth.json')):
    print(r['mode'], round(r['itl_p50_ms'],1), round(r['itl_p99_ms'],1), round(r['p99_over_p50'],2), r['ttft_median_s'], r['slow_steps'][:4], [(t, n) for t, n, _ in r['triton_compiles']])"
  pack smooth
fi
