#!/usr/bin/env bash
# rlt-decode on the H200 in one device call: the GPU tests of the decode path (graph replay vs
# eager, fp32 token identity; bf16 agreement) and the engine GPU tests, then the offline harness
# for the base engine and for the engine with rlt-decode's features (static_buffers + graphs +
# pipeline, all on by default on CUDA),
# back to back in one lease (Ouro-1.4B shapes, random weights, bf16, Triton, 1K-token prompts):
#
#   OUT=benchmarks/results/<dir> bash scripts/decode_h200.sh
# VARIANTS (default "base decode"; nopipe = rlt-decode without its pipeline; unfused = rlt-decode with
# the small-M linear kernels off, RLT_FUSED_LINEAR=0; nosplit = rlt-decode with o_proj / down_proj on
# cuBLAS instead of split-K, RLT_SPLIT_K=0; nopdl = rlt-decode with plain kernel launches instead of
# programmatic dependent launch, RLT_PDL=0; pdl = rlt-decode with it, RLT_PDL=1; fold = rlt-decode with the
# last-arriver folds (merge into decode attention, add_norm_norm into split-K), RLT_FOLD=1; foldattn / foldsplitk /
# foldtiles = one fold site alone, RLT_FOLD=attention / split_k / tiles; prefetch = rlt-decode
# with weight L2 prefetch before the PDL wait, RLT_PREFETCH=1; paged = rlt-decode with every prompt row on
# the paged kernel, RLT_DENSE_PREFILL=0 (fresh rows read densely is the default); all = fold + prefetch; devexit = rlt-decode with device-planned
# steps under adaptive exit, --pipeline-device-exit; persist = rlt-decode with one-row steps' loops as one persistent
# kernel, --persistent-loop (rlt.decode.persistent; PERSIST_FLAGS: more of its flags, e.g.
# --feature-flag=--persistent-loop-l2-ahead=16); full = rlt-decode and rlt-prefill composed (FA4 for prompt rows
# when it imports: carry and install its wheels first); fullfold = full with RLT_FOLD=1; fullpaged = full with FA4's paged call for every prompt row, RLT_DENSE_PREFILL=0; copy = rlt-decode with step metadata copied,
# RLT_UVA=0, instead of read by the mapped-memory kernel; tiles = rlt-decode with the fused projections' launch shapes
# from TILES, RLT_LINEAR_TILES=$TILES, e.g. a sweep's winners; splitktma = rlt-decode with the split-K projections
# reading X and W through TMA, RLT_SPLIT_K_TMA=1 (the default since lease 9); notma = rlt-decode with every
# projection on pointer loads, as before lease 9: RLT_SPLIT_K_TMA=0 and the old >16-row tiles; fullrows = full with
# the fused gate/up + SiLU and split-K projections serving up to 128 rows, RLT_FUSED_ROWS=${FUSED_ROWS:-silu_mul=128,split_k=128}); fulltiles = full
# with RLT_LINEAR_TILES=$TILES; fullrowstiles = fullrows with them (a 128-row sweep's winners); dtiles / fulldtiles =
# decode / full with the decode attention's launch shapes and grid order from DTILES, RLT_DECODE_TILES=$DTILES; BENCH_ARGS (e.g. --no-sync-steps: no device
# synchronise after each step, which a pipelined loop needs to overlap), KERNELS=1 (first the kernel
# micro-benchmarks, benchmarks/decode_kernels.py, with KERNEL_ARGS), PROFILE="c=1,in=1024 ..." (a
# torch-profiler kernel table of decode steps; PROFILE_ARGS e.g. "--feature-module rlt.decode.feature
# --disable-feature graphs --disable-feature pipeline": the static path run eagerly, kernels visible),
# ONLY_WORKLOADS (replaces the workload list)
set -uo pipefail
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-decode/src:packages/rlt-prefill/src:apps/server/src:.${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${SUITE_TIMEOUT:-240} $PY -m pytest tests/gpu/test_decode_gpu.py ${EXTRA_TESTS:-tests/gpu/test_engine_gpu.py} -m gpu -q \
    -p no:cacheprovider -o addopts="" -rA -s > "$OUT/gpu-tests.log" 2>&1
  tail -5 "$OUT/gpu-tests.log"
fi
if [ "${KERNELS:-0}" = 1 ]; then
  timeout ${KERNELS_TIMEOUT:-300} $PY -m benchmarks.decode_kernels --out "$OUT/kernels.json" ${KERNEL_ARGS:-} > "$OUT/kernels.log" 2>&1
  grep -E "^(qkv|o_proj|gate_up|down_proj|lm_head|attention)" "$OUT/kernels.log" | tail -60
fi
WORKLOADS=(--workload c=1,in=1024,out=128,req=1,budget=25,name=c1-1k
           --workload c=64,in=1024,out=128,req=64,budget=35,name=c64-1k
           ${EXTRA_WORKLOADS:-})
[ -n "${ONLY_WORKLOADS:-}" ] && WORKLOADS=($ONLY_WORKLOADS)   # replaces the list above
for variant in ${VARIANTS:-base decode}; do
  extra=()
  fused=1
  split=1
  pdl=${RLT_PDL:-}
  foldv=${RLT_FOLD:-}
  prefetch=${RLT_PREFETCH:-}
  dense=${RLT_DENSE_PREFILL:-}
  tiles=${RLT_LINEAR_TILES:-}
  splitktma=${RLT_SPLIT_K_TMA:-}
  rows=${RLT_FUSED_ROWS:-}
  dtiles=${RLT_DECODE_TILES:-}
  uva=
  case $variant in  # base: the base engine; decode: rlt-decode's features; nopipe: rlt-decode without its pipeline
    none) continue ;;  # VARIANTS=none: no offline runs (a PROFILE alone)
    decode) extra=(--feature-module rlt.decode.feature) ;;
    nopipe) extra=(--feature-module rlt.decode.feature --disable-feature pipeline) ;;
    unfused) extra=(--feature-module rlt.decode.feature); fused=0 ;;
    copy) extra=(--feature-module rlt.decode.feature); uva=0 ;;
    nosplit) extra=(--feature-module rlt.decode.feature); split=0 ;;
    nopdl) extra=(--feature-module rlt.decode.feature); pdl=0 ;;
    pdl) extra=(--feature-module rlt.decode.feature); pdl=1 ;;
    fold) extra=(--feature-module rlt.decode.feature); foldv=1 ;;
    foldattn) extra=(--feature-module rlt.decode.feature); foldv=attention ;;
    foldsplitk) extra=(--feature-module rlt.decode.feature); foldv=split_k ;;
    foldtiles) extra=(--feature-module rlt.decode.feature); foldv=tiles ;;
    prefetch) extra=(--feature-module rlt.decode.feature); prefetch=1 ;;
    foldprefetch) extra=(--feature-module rlt.decode.feature); foldv=1; prefetch=1 ;;
    paged) extra=(--feature-module rlt.decode.feature); dense=0 ;;
    all) extra=(--feature-module rlt.decode.feature); foldv=1; prefetch=1 ;;
    tiles) extra=(--feature-module rlt.decode.feature); tiles=${TILES:?the tiles variant needs TILES} ;;
    splitktma) extra=(--feature-module rlt.decode.feature); splitktma=1 ;;
    notma) extra=(--feature-module rlt.decode.feature); splitktma=0; tiles="rope_kv:64=64x32x128x4x4,silu_mul:64=64x32x128x4x3" ;;
    devexit) extra=(--feature-module rlt.decode.feature --feature-flag=--pipeline-device-exit) ;;
    persist) extra=(--feature-module rlt.decode.feature --feature-flag=--persistent-loop ${PERSIST_FLAGS:-}) ;;
    full) extra=(--feature-module rlt.decode.feature --feature-module rlt.prefill.features) ;;
    fullfold) extra=(--feature-module rlt.decode.feature --feature-module rlt.prefill.features); foldv=1 ;;
    fullpaged) extra=(--feature-module rlt.decode.feature --feature-module rlt.prefill.features); dense=0 ;;
    fullrows) extra=(--feature-module rlt.decode.feature --feature-module rlt.prefill.features); rows=${FUSED_ROWS:-silu_mul=128,split_k=128} ;;
    fulltiles) extra=(--feature-module rlt.decode.feature --feature-module rlt.prefill.features); tiles=${TILES:?fulltiles needs TILES} ;;
    dtiles) extra=(--feature-module rlt.decode.feature); dtiles=${DTILES:?dtiles needs DTILES} ;;
    fulldtiles) extra=(--feature-module rlt.decode.feature --feature-module rlt.prefill.features); dtiles=${DTILES:?fulldtiles needs DTILES} ;;
    fullrowstiles) extra=(--feature-module rlt.decode.feature --feature-module rlt.prefill.features); rows=${FUSED_ROWS:-silu_mul=128,split_k=128}
      tiles=${TILES:?fullrowstiles needs TILES} ;;
  esac
  RLT_DECODE_TILES=$dtiles RLT_FUSED_ROWS=$rows RLT_SPLIT_K_TMA=$splitktma RLT_LINEAR_TILES=$tiles RLT_DENSE_PREFILL=$dense RLT_FOLD=$foldv RLT_PREFETCH=$prefetch RLT_PDL=$pdl RLT_SPLIT_K=$split RLT_UVA=${uva:-${RLT_UVA:-}} RLT_FUSED_LINEAR=$fused timeout ${BENCH_TIMEOUT:-200} $PY -m benchmarks.offline_bench --model ouro-1.4b --dtype bfloat16 --attention-backend triton \
    --work-dir /tmp/rlt-bench --out-dir "$OUT/$variant" --reps 3 --warmup-output-len 4 "${extra[@]}" ${BENCH_ARGS:-} "${WORKLOADS[@]}" \
    > "$OUT/$variant.log" 2>&1
  echo "== $variant"; grep -E "^\| (c1-1k|c64-1k|c65-1k|c128-1k|c128-512|c64-1k-adaptive|c64-refill|c64-refill-adaptive|c1-1k-adaptive) \| triton" "$OUT/$variant/results.md" || tail -20 "$OUT/$variant.log"
done
if [ -n "${PROFILE:-}" ]; then
  args=(); for p in $PROFILE; do args+=(--profile "$p"); done
  timeout ${PROFILE_TIMEOUT:-150} $PY -m benchmarks.offline_bench --model ouro-1.4b --dtype bfloat16 --attention-backend triton \
    --work-dir /tmp/rlt-bench --out-dir "$OUT/profile" ${PROFILE_ARGS:-} "${args[@]}" > "$OUT/profile.log" 2>&1
  grep -A 16 "Largest kernels" "$OUT/profile/profile_summary.md" | head -60 || tail -20 "$OUT/profile.log"
fi
