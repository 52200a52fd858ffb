#!/usr/bin/env bash
# What the next H200 lease runs first (planned 2026-12-04/05, when no device was lent): CALL=a..h, one
# device call each (<= 600 s), results under $OUT/$CALL. Run from the repo root:
#   OUT=benchmarks/results/h200-<date>-lease8 CALL=a bash scripts/next_lease.sh
#   a  the whole GPU suite on the default build (PDL on: not yet run with it), incl. the new fold /
#      prefetch tests (tests/gpu/test_triton_attention_gpu.py::test_folded_merge_matches_merge_kernel,
#      test_fused_ops_gpu.py::test_split_k_folds_add_norm_norm, test_decode_gpu.py::test_device_side_switches_change_nothing)
#   b  decode kernels: split-K + norm unfolded vs folded at 1/4/64 rows, decode attention merge vs folded merge;
#      then rlt-decode end to end, default vs RLT_FOLD=1 (C=1, C=64; same build back to back)
#   bc the end-to-end half of b and c in one call: rlt-decode default vs RLT_FOLD=1 vs RLT_PREFETCH=1 vs both
#      (C=1, C=64; the fold tests run in a's suite)
#   c  rlt-decode end to end, default vs RLT_PREFETCH=1 vs all three switches (+ RLT_DENSE_PREFILL: the
#      prompts' attention), plus the C=128 1K/128 end-to-end workload for each
#   d  self-speculation re-measured on this build (scripts/spec_h200.sh: d=1/2, K=2..8, measured acceptance)
#   e  the Triton prefill kernel with fresh prompt rows read densely through TMA (RLT_DENSE_PREFILL): the attention
#      micro-benchmark (8K: paged vs dense, % of the matmul rate; target 60 %), then Triton-only 8K prefill end to
#      end, dense off / on (FA4 not installed in this call, so prompt rows stay on Triton)
#   f  device-planned steps under adaptive exit (--pipeline-device-exit) against the host-planned pipeline: C=64 with
#      slot refill (256 requests), fixed depth and tau = 0.7 (lease 3: a tau = 0.7 token cost 0.71 of a fixed-depth one
#      for 0.56 of the loops), and C=1 at tau = 0.7; the decode GPU tests first (test_device_planned_steps_equal_eager)
#   g  the fused q/k/v+RoPE and gate/up+SiLU projections' launch shapes at 1 and 64 rows: 16/32-wide column tiles
#      (4 warps) and 64-wide ones (8 warps) x K splits 1/2/4 (benchmarks/decode_kernels.py's sweep); at 64 rows
#      the default 32-wide tiles load as many activation bytes as weight bytes per program (C=64: the
#      projections take ~1.1 of 4.55 ms per loop step at ~2-2.8 TB/s) — a better shape becomes fused_linear._tiles
#   h  FA4 installed: the FA4 GPU tests (incl. the dense varlen call for fresh prompt rows), 8K prefill with FA4 for
#      prompt rows paged vs dense (RLT_DENSE_PREFILL=1; issue 11's 45,000 tok/s), then C=128 1K/128 end to end (the
#      issue's e2e target, 2,500 tok/s) with every feature package composed as a server
#      would (rlt-decode + rlt-prefill: FA4 for the prompt rows), paged vs dense; lease 7 measured it with
#      rlt-decode alone on Triton (2,313). FA4's wheels: carry .whl/fa4a in an earlier call of the lease and
#      .whl/fa4b in this one (64 MiB per call; the warm machine keeps both), as lease 7's calls c and d did
# Then: flip rlt.attention.fold.DEFAULT / the prefetch / dense-prefill defaults only if they pay, and record
# everything in $OUT/README.md (device, versions, command, median of three after one warm-up).
# The eight calls need ~3,500 s; a 1,800 s lease runs a (carrying .whl/fa4a), b, f (correctness of everything new,
# then the C=1 folds and the adaptive-exit acceptance item) and leaves h, g, e, c, d for the next.
set -uo pipefail
OUT=${OUT:?set OUT}
CALL=${CALL:?set CALL to one of a..h}
R=$OUT/$CALL
mkdir -p "$R"
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-serve/src:packages/rlt-decode/src:packages/rlt-kvcache/src:packages/rlt-spec/src:packages/rlt-prefill/src:apps/server/src:.
{ python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name(0))"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null; git log --oneline -1; } > "$R/versions.txt"
case $CALL in
  a)
    timeout ${SUITE_TIMEOUT:-540} python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider -o addopts="" -rfEs \
      --durations=15 > "$R/gpu-suite.log" 2>&1
    echo "rc $?"
    grep -E "^(FAILED|ERROR)|passed|failed" "$R/gpu-suite.log" | tail -25 ;;
  b)
    timeout 150 python3 -m pytest tests/gpu/test_triton_attention_gpu.py tests/gpu/test_fused_ops_gpu.py -m gpu -q \
      -p no:cacheprovider -o addopts="" -rfE -k "fold" > "$R/fold-tests.log" 2>&1
    grep -E "passed|failed|^FAILED|^ERROR" "$R/fold-tests.log" | tail -6
    timeout 200 python3 -m benchmarks.decode_kernels --parts linear,attention --rows 1,4,64 --sweep-rows "" --shapes "qkv+rope+kv,o_proj,gate_up+silu,down_proj" \
      --attention-cases 1x1024,64x1024 --out "$R/kernels.json" > "$R/kernels.log" 2>&1
    grep -E "^(qkv|o_proj|gate_up|down_proj|attention)" "$R/kernels.log" | tail -24
    SKIP_TESTS=1 VARIANTS="decode fold" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=110 OUT=$R bash scripts/decode_h200.sh ;;
  bc)
    SKIP_TESTS=1 VARIANTS="decode fold prefetch foldprefetch" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=110 OUT=$R bash scripts/decode_h200.sh ;;
  c)
    SKIP_TESTS=1 VARIANTS="decode prefetch all" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=170 \
      EXTRA_WORKLOADS="--workload c=128,in=1024,out=128,req=128,budget=35,name=c128-1k" OUT=$R bash scripts/decode_h200.sh ;;
  d)
    OUT=$R bash scripts/spec_h200.sh ;;
  e)
    timeout 240 python3 benchmarks/attention_bench.py --out "$R/attention_bench.json" > "$R/attention_bench.log" 2>&1
    grep -E "prefill|ceilings" "$R/attention_bench.log" | head -12
    for dense in 0 1; do
      RLT_DENSE_PREFILL=$dense timeout 150 python3 -m benchmarks.prefill_bench --workload single profile --reps 3 \
        > "$R/prefill8k-dense$dense.log" 2>&1
      echo "== dense $dense"; grep -E '"workload": "single"' "$R/prefill8k-dense$dense.log" | tail -1 | cut -c1-300
    done ;;
  f)
    timeout 120 python3 -m pytest tests/gpu/test_decode_gpu.py -m gpu -q -p no:cacheprovider -o addopts="" -rfE \
      -k "device_planned or pipelined" > "$R/devexit-tests.log" 2>&1
    grep -E "passed|failed|^FAILED|^ERROR" "$R/devexit-tests.log" | tail -6
    SKIP_TESTS=1 VARIANTS="decode devexit" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=200 \
      ONLY_WORKLOADS="--workload c=64,in=1024,out=128,req=256,budget=40,name=c64-refill --workload c=64,in=1024,out=128,req=256,tau=0.7,budget=40,name=c64-refill-adaptive --workload c=1,in=1024,out=128,req=1,tau=0.7,budget=25,name=c1-1k-adaptive" \
      OUT=$R bash scripts/decode_h200.sh ;;
  g)
    timeout 540 python3 -m benchmarks.decode_kernels --parts linear --rows 1,64 --sweep-rows 1,64 \
      --shapes "qkv+rope+kv,gate_up+silu" --out "$R/tiles.json" > "$R/tiles.log" 2>&1
    grep -E "^(qkv|gate_up)" "$R/tiles.log" | tail -8 ;;
  h)
    . scripts/install_carried_wheels.sh .whl/fa4a .whl/fa4b
    if ! python3 -c "import flash_attn.cute" > "$R/fa4-import.log" 2>&1; then
      echo "FA4 does not import (was .whl/fa4a carried by an earlier call of this machine?): running bc instead"
      tail -3 "$R/fa4-import.log"; CALL=bc exec bash "$0"
    fi
    echo "fa4 ok"
    timeout 100 python3 -m pytest tests/gpu/test_flash_gpu.py tests/gpu/test_prefill_gpu.py -m gpu -q -p no:cacheprovider \
      -o addopts="" -rfE -k "dense_fresh or fa4" > "$R/fa4-tests.log" 2>&1
    grep -E "passed|failed|^FAILED|^ERROR" "$R/fa4-tests.log" | tail -6
    for dense in 0 1; do
      RLT_DENSE_PREFILL=$dense timeout 80 python3 -m benchmarks.prefill_bench --workload single profile --reps 3 \
        > "$R/prefill8k-fa4-dense$dense.log" 2>&1
      echo "== 8K FA4 dense $dense"; grep -E '"workload": "single"' "$R/prefill8k-fa4-dense$dense.log" | tail -1 | cut -c1-200
    done
    SKIP_TESTS=1 VARIANTS="${H_VARIANTS:-full fulldense}" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=${H_TIMEOUT:-150} \
      ONLY_WORKLOADS="--workload c=128,in=1024,out=128,req=128,budget=40,name=c128-1k" OUT=$R bash scripts/decode_h200.sh ;;
  *) echo "unknown CALL $CALL"; exit 2 ;;
esac
