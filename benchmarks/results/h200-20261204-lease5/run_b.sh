#!/usr/bin/env bash
# Lease 5, call B: decode smoothness with the slow-step / Triton-compile record (chunked at ratio 1.5
# and 2, the vLLM-style 2,048 budget without the cap), and the 8K Triton prefill's device idle gaps.
# Carries .whl/fa4a (first half of FA4) for call C, which must follow within the machine's idle window.
set -u
R=/tmp/rb; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-serve/src:packages/rlt-decode/src:packages/rlt-kvcache/src:packages/rlt-spec/src:packages/rlt-prefill/src:apps/server/src:.
PY=python3
pack() { tar czf "$OUT/rb.tgz" -C /tmp rb; echo "== $(date +%T) $1 done"; }
$PY -c 'from benchmarks.report import source_fingerprint as f; print("source", f())' > $R/versions.txt 2>&1; cat $R/versions.txt
ls -la .whl/fa4a | tail -3
timeout 230 $PY -m benchmarks.prefill_bench --workload smooth --modes chunked chunked-r2 budget2048 --duration 15 \
  --out $R/smooth.json > $R/smooth.log 2>&1
$PY - <<'PY'
import json
for r in json.load(open('/tmp/rb/smooth.json')):
    print(r['mode'], 'p50', round(r['itl_p50_ms'], 1), 'p99', round(r['itl_p99_ms'], 1), 'ratio', round(r['p99_over_p50'], 2),
          'ttft', r['ttft_median_s'], 'slow', r['slow_steps'][:6], 'compiles', [(t, n) for t, n, _ in r['triton_compiles']][:8])
PY
pack smooth
timeout 60 $PY -m benchmarks.prefill_bench --workload profile --out $R/prefill8k.json > $R/prefill8k.log 2>&1
tail -1 $R/prefill8k.log | $PY -c "import json,sys; r=json.loads(sys.stdin.read()); print(r['wall_ms_profiled'], r['device_busy_ms'], r['idle_gaps_over_50us'])"
pack profile
