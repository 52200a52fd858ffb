#!/usr/bin/env bash
# Lease 4 (one device call, ~9.5 min cap): serving with the startup warm-up (C=64 twice, C=128, vs offline),
# issue 12's (b) prefix-cache bench, the Triton prefill variants at 8K (first 10: default vs old kernel),
# the fused-linear GPU tests (fp32 tile fix). Results tarred into $OUT/r.tgz after every step.
#   bash benchmarks/results/h200-20261204-lease4/run.sh      # on the H200, carry .whl
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-serve/src:packages/rlt-decode/src:packages/rlt-kvcache/src:packages/rlt-spec/src:packages/rlt-prefill/src:apps/server/src:.
PY=python3
pack() { tar czf "$OUT/r.tgz" -C /tmp r; echo "== $(date +%T) $1 done"; }
{ $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; git log --oneline -1 2>/dev/null; } > $R/versions.txt 2>&1
cat $R/versions.txt
OUT=$R/serve CONCS="64 64 128" BENCH_TIMEOUT=80 OFFLINE_TIMEOUT=110 timeout 290 bash scripts/serve_h200.sh > $R/serve.log 2>&1
tail -6 $R/serve.log; grep -E "warm-up|graphs:" $R/serve/server.log; pack serve
timeout 150 $PY -m benchmarks.kvcache_bench --model ouro-1.4b --dtype bfloat16 --preset h200 --attention-backend triton \
  --only prefix --work-dir /tmp/rlt-kvb --out-dir $R/kvcache > $R/kvcache.log 2>&1
grep -E '^\(b\)' $R/kvcache.log; tail -3 $R/kvcache.log; pack kvcache
timeout 80 $PY benchmarks/prefill_kernel_sweep.py --sizes 8192 --top 0 --limit 10 --out $R/prefill_kernel_sweep.json \
  > $R/prefill_kernel_sweep.log 2>&1
tail -14 $R/prefill_kernel_sweep.log; pack sweep
timeout 45 $PY -m pytest tests/gpu/test_fused_ops_gpu.py -m gpu -q -p no:cacheprovider -o addopts="" -rfE > $R/fused-tests.txt 2>&1
tail -3 $R/fused-tests.txt; pack tests
