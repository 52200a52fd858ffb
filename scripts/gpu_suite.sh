#!/usr/bin/env bash
# The GPU suite and benchmarks in one call (run from the repo root on a CUDA/ROCm machine):
#   OUT=benchmarks/results/h200-gpu bash scripts/gpu_suite.sh
# 1. pytest -m gpu (kernels vs the Torch reference, engine vs the oracle, bf16 end to end);
# 2. the attention micro-benchmarks (benchmarks/attention_bench.py) if present
#    (BENCH_TIMEOUT seconds, default 120; BENCH_ARGS=--sweep adds the tile/variant sweep);
# 3. the offline engine benchmarks (scripts/bench_h200.sh) unless SKIP_BENCH=1.
set -uo pipefail
OUT=${OUT:-benchmarks/results/gpu-$(date +%Y%m%d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-serve/src:apps/server/src:.${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_suite: no GPU visible to torch here; nothing to run" | tee "$OUT/gpu_suite.txt"
  exit 0
fi
{ $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'hip', torch.version.hip, 'triton', triton.__version__, torch.cuda.get_device_name(0))"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null; } | tee "$OUT/versions.txt"
rc=0
timeout ${SUITE_TIMEOUT:-300} $PY -m pytest tests/gpu -m gpu -q -p no:cacheprovider -o addopts="" -rA -s 2>&1 | tee "$OUT/gpu_suite.log" | grep -v "^PASSED" | tail -80 | tee "$OUT/gpu_suite.txt" || rc=1
if [ -f benchmarks/attention_bench.py ]; then
  timeout ${BENCH_TIMEOUT:-120} $PY benchmarks/attention_bench.py ${BENCH_ARGS:-} --out "$OUT/attention_bench.json" 2>&1 \
    | tee "$OUT/attention_bench.log" | tail -30 | tee "$OUT/attention_bench.txt"
fi
if [ "${SKIP_BENCH:-0}" != 1 ] && [ -f scripts/bench_h200.sh ]; then
  OUT="$OUT/offline" bash scripts/bench_h200.sh
fi
exit $rc
