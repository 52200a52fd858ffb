#!/usr/bin/env bash
# Lease 5, call D (carries .whl/fa4a for call E): after the per-step integers were unspecialised in
# the Triton kernels: the no-compile-after-warm-up GPU test and the kernel GPU tests; decode
# smoothness again (chunked at ratio 1.5, wavefront); C=1 plain decode (spec_bench's baselines, to
# compare with call A's 191.6 tok/s default build before the change).
set -u
R=/tmp/rd; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-serve/src:packages/rlt-decode/src:packages/rlt-kvcache/src:packages/rlt-spec/src:packages/rlt-prefill/src:apps/server/src:.
PY=python3
pack() { tar czf "$OUT/rd.tgz" -C /tmp rd; echo "== $(date +%T) $1 done"; }
$PY -c 'from benchmarks.report import source_fingerprint as f; print("source", f())' > $R/versions.txt 2>&1; cat $R/versions.txt
timeout 200 $PY -m pytest tests/gpu/test_compiles_gpu.py tests/gpu/test_fused_ops_gpu.py tests/gpu/test_triton_attention_gpu.py \
  tests/gpu/test_decode_gpu.py -m gpu -q -p no:cacheprovider -o addopts="" -rfE > $R/tests.txt 2>&1
grep -E "passed|failed|Triton compile|Error" $R/tests.txt | tail -6; pack tests
timeout 150 $PY -m benchmarks.prefill_bench --workload smooth --modes chunked wavefront --duration 15 \
  --out $R/smooth.json > $R/smooth.log 2>&1
$PY - <<'PY'
import json
for r in json.load(open('/tmp/rd/smooth.json')):
    print(r['mode'], 'p50', round(r['itl_p50_ms'], 1), 'p99', round(r['itl_p99_ms'], 1), 'ratio', round(r['p99_over_p50'], 2),
          'ttft', r['ttft_median_s'], 'slow', r['slow_steps'][:4], 'compiles', [(t, n) for t, n, _ in r['triton_compiles']][:6])
PY
pack smooth
timeout 100 $PY -m benchmarks.spec_bench --preset h200 --scales 1.0 --ks 2 --ds 2 --targets 0.8 --big-c 0 --deadline 0 \
  --out-dir $R/plain > $R/plain.log 2>&1
grep -E "plain_" $R/plain.log | head -3; pack plain
