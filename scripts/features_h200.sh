#!/usr/bin/env bash
# The feature packages on the H200 (rlt-prefill, rlt-kvcache, rlt-spec, prompt logprobs) in one or
# two device calls; each step writes into $OUT/<step>/ (Ouro-1.4B shapes, random weights, bf16):
#
#   OUT=benchmarks/results/<dir> STEPS="tests kvcache" bash scripts/features_h200.sh
#   OUT=... STEPS="prefill spec" WHEELS=".whl/a .whl/b" bash scripts/features_h200.sh   # FA4 carried
#
# Steps (STEPS, default "tests prefill kvcache spec"):
#   tests    pytest -m gpu of tests/gpu/test_{prefill,kvcache,spec}_gpu.py (FEATURE_TESTS to change);
#   prefill  benchmarks/prefill_bench.py: single 8K prefill (default path; packed_prefill puts
#            prompt rows on FA4 when it imports), its kernel-time profile, one 32K prompt under a
#            2,048 budget, its prompt logprobs' peak memory (issue 16), ITL p50/p99 of 32 decoders
#            under 16K arrivals (full / chunked / wavefront / chunked-r2 / budget2048, step-time fit);
#   prefillkernel  benchmarks/prefill_kernel_sweep.py: Triton paged-prefill variants at 8K/2K/32K
#            against the torch reference, % of the matmul rate, the best config (not in the default
#            STEPS: run it on its own, about 5 minutes);
#   kvcache  benchmarks/kvcache_bench.py (issue 12's (a) (b) (c));
#   spec     benchmarks/spec_bench.py --preset h200 (issue 13's speed rows: C=1 sync/overlapped K x d vs
#            measured acceptance, C=64 adaptive vs plain; ~6 min).
set -uo pipefail
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-serve/src:packages/rlt-decode/src:packages/rlt-kvcache/src:packages/rlt-spec/src:packages/rlt-prefill/src:apps/server/src:.${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
STEPS=" ${STEPS:-tests prefill kvcache spec} "
if [ -n "${WHEELS:-}" ]; then
  # shellcheck disable=SC1091,SC2086
  . scripts/install_carried_wheels.sh $WHEELS
fi
{ $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "from rlt.attention import BACKENDS as B; print('importable attention backends:', [n for n, e in B.items() if not e.missing_modules()])"
} 2>&1 | tee "$OUT/versions.txt"
rc=0
step() { [[ $STEPS == *" $1 "* ]]; }
if step tests; then
  mkdir -p "$OUT/tests"
  # shellcheck disable=SC2086
  timeout ${TEST_TIMEOUT:-300} $PY -m pytest ${FEATURE_TESTS:-tests/gpu/test_prefill_gpu.py tests/gpu/test_kvcache_gpu.py tests/gpu/test_spec_gpu.py} \
    -m gpu -q -p no:cacheprovider -o addopts="" -rA > "$OUT/tests/pytest.log" 2>&1 || rc=1
  grep -v "^PASSED" "$OUT/tests/pytest.log" | tail -40
fi
if step prefill; then
  mkdir -p "$OUT/prefill"
  # shellcheck disable=SC2086
  timeout ${PREFILL_TIMEOUT:-480} $PY -m benchmarks.prefill_bench --workload ${PREFILL_WORKLOADS:-single profile long logprobs smooth} \
    --duration ${SMOOTH_SECONDS:-15} --out "$OUT/prefill/prefill_bench.json" > "$OUT/prefill/log.txt" 2>&1 || rc=1
  grep '^{' "$OUT/prefill/log.txt" | cut -c1-400; tail -3 "$OUT/prefill/log.txt"
fi
if step prefillkernel; then
  mkdir -p "$OUT/prefillkernel"
  timeout ${KERNEL_TIMEOUT:-480} $PY benchmarks/prefill_kernel_sweep.py --out "$OUT/prefillkernel/prefill_kernel_sweep.json" \
    > "$OUT/prefillkernel/log.txt" 2>&1 || rc=1
  tail -45 "$OUT/prefillkernel/log.txt"
fi
if step kvcache; then
  # shellcheck disable=SC2086
  timeout ${KVCACHE_TIMEOUT:-300} $PY -m benchmarks.kvcache_bench --model ouro-1.4b --dtype bfloat16 --attention-backend triton \
    --work-dir /tmp/rlt-kvb --out-dir "$OUT/kvcache" ${KVCACHE_ARGS:-} > "$OUT/kvcache.log" 2>&1 || rc=1
  tail -30 "$OUT/kvcache.log"
fi
if step spec; then
  # shellcheck disable=SC2086
  timeout ${SPEC_TIMEOUT:-450} $PY -m benchmarks.spec_bench --preset h200 ${SPEC_ARGS:-} --out-dir "$OUT/spec" \
    > "$OUT/spec.log" 2>&1 || rc=1
  tail -45 "$OUT/spec.log"
fi
exit $rc
