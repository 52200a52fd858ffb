#!/usr/bin/env bash
# Lease 5, call A (~8 min cap): decode smoothness under 16K arrivals with the cap (issue 11),
# the 8K prefill's kernel-time profile on Triton attention (issue 11: where the non-attention time goes),
# self-speculation calibration at smaller loop-update scales and C=1 rows at the chosen ones (issue 13).
#   bash benchmarks/results/h200-20261204-lease5/run.sh      # on the H200
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-serve/src:packages/rlt-decode/src:packages/rlt-kvcache/src:packages/rlt-spec/src:packages/rlt-prefill/src:apps/server/src:.
PY=python3
pack() { tar czf "$OUT/r.tgz" -C /tmp r; echo "== $(date +%T) $1 done"; }
{ $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c 'from benchmarks.report import source_fingerprint as f; print("source", f())'; } > $R/versions.txt 2>&1
cat $R/versions.txt
timeout 170 $PY -m benchmarks.prefill_bench --workload smooth --modes chunked wavefront --duration 15 \
  --out $R/smooth.json > $R/smooth.log 2>&1
grep -v Warning $R/smooth.log | tail -3 | cut -c1-400; pack smooth
timeout 70 $PY -m benchmarks.prefill_bench --workload single profile --reps 3 --out $R/prefill8k.json > $R/prefill8k.log 2>&1
tail -2 $R/prefill8k.log | cut -c1-1500; pack prefill8k
timeout 250 $PY -m benchmarks.spec_bench --preset h200 --scales 0.001,0.0005,0.0003,0.0002,0.0001 --targets 0.8,0.9 \
  --ks 2,4 --ds 1,2 --big-c 0 --cap 4 --deadline 150 --out-dir $R/spec > $R/spec.log 2>&1
grep -E "calibration|chosen|tok/s" $R/spec.log | tail -20; pack spec
