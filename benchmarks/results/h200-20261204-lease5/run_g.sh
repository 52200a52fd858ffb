#!/usr/bin/env bash
# Lease 5, call G: the GPU engine tests after the 16-byte-aligned uploader and the bulk KV allocator
# (engine, prefill without FA, spec, kvcache, no-compile-after-warm-up), then the smooth chunked run
# with the harness's engine warm-up.
set -u
R=/tmp/rg; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-serve/src:packages/rlt-decode/src:packages/rlt-kvcache/src:packages/rlt-spec/src:packages/rlt-prefill/src:apps/server/src:.
PY=python3
pack() { tar czf "$OUT/rg.tgz" -C /tmp rg; echo "== $(date +%T) $1 done"; }
$PY -c 'from benchmarks.report import source_fingerprint as f; print("source", f())' > $R/versions.txt 2>&1; cat $R/versions.txt
timeout 320 $PY -m pytest tests/gpu/test_compiles_gpu.py tests/gpu/test_engine_gpu.py tests/gpu/test_prefill_gpu.py \
  tests/gpu/test_spec_gpu.py tests/gpu/test_kvcache_gpu.py -m gpu -q -p no:cacheprovider -o addopts="" -rfE > $R/tests.txt 2>&1
grep -E "passed|failed|FAILED|Error" $R/tests.txt | tail -8; pack tests
timeout 150 $PY -m benchmarks.prefill_bench --workload smooth --modes chunked --duration 15 --out $R/smooth.json > $R/smooth.log 2>&1
$PY -c "
import json
for r in json.load(open('/tmp/rg/smooth.json')):
    print(r['mode'], round(r['itl_p50_ms'],1), round(r['itl_p99_ms'],1), round(r['p99_over_p50'],2), r['ttft_median_s'], r['slow_steps'][:4], [(t, n) for t, n, _ in r['triton_compiles']])"
pack smooth
