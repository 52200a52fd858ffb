#!/usr/bin/env bash
# The GPU suite and benchmarks in one call (run from the repo root on a CUDA/ROCm machine):
#   OUT=benchmarks/results/h200-gpu bash scripts/gpu_suite.sh
# Steps (STEPS, default "suite attention offline"):
#   suite     pytest -m gpu over SUITE_PATHS (default tests/gpu): kernels vs the Torch reference,
#             engine vs the oracle, bf16 end to end, FlashAttention adapters where importable;
#   attention the attention micro-benchmarks (benchmarks/attention_bench.py; BENCH_TIMEOUT seconds,
#             default 120; BENCH_ARGS=--sweep adds the tile/variant sweep);
#   offline   the offline engine benchmarks (scripts/bench_h200.sh; FIXED_DEPTH=1 for its
#             fixed-depth set, which lets auto choose FlashAttention).
# WHEELS="dir ..." first installs carried wheels (scripts/install_carried_wheels.sh), e.g. FA4's.
set -uo pipefail
OUT=${OUT:-benchmarks/results/gpu-$(date +%Y%m%d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-serve/src:packages/rlt-decode/src:packages/rlt-kvcache/src:packages/rlt-spec/src:packages/rlt-prefill/src:apps/server/src:.${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
STEPS=" ${STEPS:-suite attention offline} "
if [ -n "${WHEELS:-}" ]; then
  # shellcheck disable=SC1091,SC2086
  . scripts/install_carried_wheels.sh $WHEELS
fi
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_suite: no GPU visible to torch here; nothing to run" | tee "$OUT/gpu_suite.txt"
  exit 0
fi
{ $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'hip', torch.version.hip, 'triton', triton.__version__, torch.cuda.get_device_name(0))"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null; } | tee "$OUT/versions.txt"
$PY -c "from rlt.attention import BACKENDS as B; print('importable attention backends:', [n for n, e in B.items() if not e.missing_modules()])" \
  | tee -a "$OUT/versions.txt"
rc=0
if [[ $STEPS == *" suite "* ]]; then
  # shellcheck disable=SC2086
  timeout ${SUITE_TIMEOUT:-300} $PY -m pytest ${SUITE_PATHS:-tests/gpu} -m gpu -q -p no:cacheprovider -o addopts="" -rA -s 2>&1 \
    | tee "$OUT/gpu_suite.log" | grep -v "^PASSED" | tail -80 | tee "$OUT/gpu_suite.txt" || rc=1
fi
if [[ $STEPS == *" attention "* ]]; then
  # shellcheck disable=SC2086
  timeout ${BENCH_TIMEOUT:-120} $PY benchmarks/attention_bench.py ${BENCH_ARGS:-} --out "$OUT/attention_bench.json" 2>&1 \
    | tee "$OUT/attention_bench.log" | tail -30 | tee "$OUT/attention_bench.txt"
fi
if [[ $STEPS == *" offline "* ]]; then
  OUT="$OUT/offline" bash scripts/bench_h200.sh || rc=1
fi
exit $rc
