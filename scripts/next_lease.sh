#!/usr/bin/env bash
# H200 lease calls, CALL=a..i (and mk, at, fh, sp, b2, bc, d2, g2, g3, g4, g5, g6, g7, g8, g9, h200, k128, n, p, pf, wd), one device call each (<= 600 s), results under $OUT/$CALL. From the repo root:
#   OUT=benchmarks/results/h200-<date>-leaseN CALL=g bash scripts/next_lease.sh
# Lease 9 (benchmarks/results/h200-20261205-lease9) ran g3, a, g2, d2 (lags 2, 1), b2, i's budgets and g4's end-to-end
# half: TMA tiles above 16 rows and the split-K projections through TMA paid and are on by default; the suite found
# two defects (dense prefill at head_dim < 16, warm-up missing lone-prompt tiles), fixed on CPU after the lease; lease
# 10 (an H100, benchmarks/results/h100-20261206-lease10) re-ran them and most of the suite: all passed, no timings. A
# lease has 1,800 s of device time and each call up to 600 s, so not all of these fit one lease. Lease 11 (an H100,
# benchmarks/results/h100-20261206-lease11) ran n, g5 (its C=128 half did not fit 80 GB), i's prefill profile and the
# penalties' GPU test. Lease 12 (an H100, benchmarks/results/h100-20261206-lease12) ran p (prefetch alone: slower), g7
# (the 128-row q/k/v tiles: +2 % at C=65, the default since), g8 (the one-row sweep through TMA: nothing) and d2's lags
# 0 / 1 (lag 0 slower), and g9's sweep (the 64-row split-K plans: 0.5 us per layer, not timed end to end). Lease 13 (an
# H100, benchmarks/results/h100-20261206-lease13) ran at (the decode attention tiles: heads-fastest grid + 3 stages,
# C=64 +0.9 %, the default since) and the 128-row projection tiles at 65 / 96 / 115 rows (the default from 96 rows
# since). Lease 14 (an H100, benchmarks/results/h100-20261207-lease14) ran fh (the fused greedy heads: a compile error
# first — fixed —, then +2.4 % / +1.9 % at d = 2, K = 8: the default since), a (the whole suite: 222 passed) and sp
# (a chain step 1.042x a plain one with the fused heads, 1.067x without). Lease 15 (H100s,
# benchmarks/results/h100-20261207-lease15) ran hs (16384 x 8: the heads' default since) and mk (the persistent
# GEMV-chain probe: 1.08 ms a loop against 1.40 for cuBLAS + elementwise; its stream alone at 97 % of the read rate).
# Lease 16 (H100s, benchmarks/results/h100-20261207-lease16; eleven H200 starts refused) ran ov (rows in groups on
# parallel streams: 1.28x one call, not built) and a (the whole suite: 222 passed). Lease 17 (an H100,
# benchmarks/results/h100-20261207-lease17) ran wd (wide chains: 1.80x plain at a plain chain's acceptance 0.83 with the
# fused wide heads; their GPU test failed for mixed draft depths in one step — fixed on CPU, not re-run). Lease 18 (an
# H100, benchmarks/results/h100-20261207-lease18) ran wd (the fixed path's GPU test passed; 1.83x), a (228 passed),
# plain decode against the tree before wide chains (equal) and spec_bench with width 4 (the default since); lease 19
# (an H100) the one-pass wide drafts (GPU test passed; 1.84x, +0.6 % against W passes).
# Lease 20 (an H100 given for an H200 call, benchmarks/results/h100-20261207-lease20) ran pf (the fused projections
# at prompt-sized rows: 7-19 % slower than cuBLAS + the elementwise kernels, not built) and h200 (C=128 did not fit).
# The 2026-12-07 evening session (no lease: two H200 starts refused, then loans paused) built the persistent_loop
# feature (rlt.decode.persistent: one-row decode steps' loops as ONE persistent kernel) — compiled with NVRTC and
# checked on CPU only. Lease 21 (2026-12-07/08, benchmarks/results/h200-20261207-lease21: an H200, then an H100)
# ran persist twice: the kernel is correct on hardware (GPU tests passed) but slower than the kernel-per-op graph
# (first version 1.975 vs 1.182 ms a loop step on the H200; after the register prologues / head merge, 1.661 at 8
# consumer warps vs 1.395 on the H100; its per-stretch breakdown: attention ~11-17 us a layer and ~30 us of barrier
# waits, during which the 12-stage rings cannot hold enough weights to keep HBM busy). Since then: the producer's
# L2 prefetch of the next phase (L2_AHEAD, --persistent-loop-l2-ahead) and early V loads in attention (V_EARLY), both
# off until measured. Next lease, FIRST on any card: CALL=persist (~3 min; the probe's variants are l2ahead 0 / 8 /
# 16 x vearly 0 / 16 at 8 warps, each with the breakdown; C=1 decode at the fastest lookahead). Then, by priority (on an
# H200 with a short lease: CALL=h200, below — k128's 32K default, C=1 / C=64 decode, mk, then wd, in one call,
# ~7-8 min):
#   k128 (H200 only: C=128 1K/128, the lease-13 defaults against the old projection rows and attention tiles;
#   K128_PART=b first — the default at 32K and 64K budgets, fullrows at 32K —, then a) > mk on an H200 (the probe
#   against that device's read rate: issue 10's C=1 projection) > i's C=128 decode profile (H200 only) > h (FA4) > d.
#   Each call:
#   n  rlt-decode with every projection on pointer loads (`notma`: the pre-lease-9 defaults) against the default, C=1
#      and C=64, back to back: lease 9 timed the two TMA flips separately (+1.2 % and +0.4-0.8 %), not together
#   g  the fused q/k/v+RoPE and gate/up+SiLU projections' launch shapes at 1 and 64 rows: 16/32-wide column tiles
#      (4 warps) and 64-wide ones (8 warps) x K splits 1/2/4 (benchmarks/decode_kernels.py's sweep); at 64 rows
#      the default 32-wide tiles load as many activation bytes as weight bytes per program (C=64: the
#      projections take ~1.1 of 4.59 ms per loop step at ~2-2.8 TB/s; C=64 decode 3,408 vs the 3,800 target) —
#      the sweep's winners are timed end to end in g2 before one becomes fused_linear._tiles; carry .whl/fa4a
#   g3 the same sweep at 64 rows with X and W read through TMA descriptors (Tiles.tma; lease 9: its winners are
#      the defaults above 16 rows now)
#   g4 the same at one row, with the split-K o_proj / down_proj plans through TMA too (RLT_SPLIT_K_TMA): C=1's
#      kernels stream at 1.4-3 TB/s; then C=1 decode with RLT_SPLIT_K_TMA=1 against the default, back to back
#   g5 the C=128 decode step's projections at 128 rows (above the fused gate/up + SiLU and split-K limits, 64): the
#      kernels with X / W through TMA against cuBLAS + the elementwise kernels, a tile / split-plan sweep; then C=128
#      1K/128 end to end with rlt-decode + rlt-prefill, default against RLT_FUSED_ROWS=silu_mul=128,split_k=128
#   p  weight L2 prefetch before the PDL wait (RLT_PREFETCH=1) without the folds, against the default, C=1 and C=64:
#      lease 8 measured it only on top of the folds (both slower there); the prefetch alone was never timed
#   g7 (fits an H100) the > 64-row bucket's winners end to end at C=65 (the bucket's smallest row count; C=128 needs an
#      H200): rlt-decode + rlt-prefill at the default, with TILES (default: lease 11's 128-row winners), and with
#      them and the gate/up + SiLU and split-K kernels serving those rows (RLT_FUSED_ROWS)
#   g8 g4's one-row sweep through TMA (every projection, split-K plans included), then C=1 decode with its winners
#      against the default, back to back
#   g9 the split-K o_proj / down_proj plans swept at 64 rows through TMA (lease 9's 64-row sweep covered only the
#      fused q/k/v and gate/up kernels), then C=64 decode with the winner (kind split_k) against the default
#   k128 (needs an H200) C=128 1K/128 end to end with rlt-decode + rlt-prefill, back to back: the default (`full`:
#      since lease 13 gate/up + SiLU and split-K take 96-128 rows in one 128-row block, and the decode attention runs
#      3 stages in the heads-fastest grid) against `fullrows` with FUSED_ROWS=silu_mul=64,split_k=64 (those kernels at
#      most 64 rows, as before; lease 13 on an H100, decode tok/s of the 128-row blocks against them: -1.0 % at C=65,
#      +1.1 % at C=96, +1.6 % at C=115) and `fulldtiles` (the attention tiles before, RLT_DECODE_TILES=decode=64x4x2x0;
#      C=64 +0.9 % twice on the H100); then C=64 decode, `decode` against `dtiles` (K128_C64=0 leaves it out)
#      (K128_PART=a, ~300 s); K128_PART=b: `full` and `fullrows` at a 32K-token step budget (lease 9: 2,401 against
#      2,341 at the harness's 16K), then `full` at 64K (K128_BUDGETS="TOKENS:VARIANTS;..." picks others). On an H100 (80 GB: 1K prompts fit 73 of the 128 rows)
#      K128_WORKLOAD=c=128,in=512,out=128,req=128,budget=40,name=c128-512 compares the same at 115 rows
#   sp (any card, ~3 min) benchmarks/spec_profile.py: plain decoding and a d = 2, K = 8 chain (scale SP_SCALE, 0.002:
#      a ~0.95) at C = 1, timed and under the torch profiler, kernels side by side: why a chain step costs ~1.06x
#      a plain one (lease 12) — issue 13's d = 2 ratio (1.73-1.77x) is that far from 1.8x; with the greedy heads in
#      one kernel (rlt.spec.heads, RLT_SPEC_FUSED_HEADS=1: the default since lease 14) and without (=0)
#   fh (any card, ~8 min) the fused heads: their GPU test, then spec_bench at d = 2, K = 8 (a ~0.95 and ~0.98), with
#      and without them, back to back (FH_SCALES / FH_TARGETS: one scale on a short lease); fs: the test and sp only
#   at the decode attention's launch shapes and grid order (DecodeTiles: keys per iteration x warps x stages, and
#      heads_fastest: the 16 head programs of a row launched together, reading the same 4 KB token stripes of its
#      pages at about the same time) swept at 64 and 128 rows x 1K (the one-split tiles: attention is ~3.3 of C=64's
#      4.5 ms per loop step, at ~3.9 TB/s) and 1 x 1K (the split tiles); then C=64 decode with the winners
#      (RLT_DECODE_TILES, > 2 % faster) against the default, and with AT_C128=1 (an H200) C=128 1K/128 end to end;
#      first the heads-fastest grid's GPU tests (both decode variants, split or not, bf16 / fp32)
#   g6 (needs an H200: C=128 does not fit 80 GB) g5 with its sweep's winners: the 128-row sweep on this device, then
#      C=128 1K/128 end to end: default, the winners' tiles (RLT_LINEAR_TILES; split-K plans too, kind split_k),
#      and the tiles with the gate/up + SiLU and split-K kernels serving 128 rows (RLT_FUSED_ROWS) — lease 11 ran g5
#      on an H100, where C=128 ran only 73 / 65 rows (memory), so its end-to-end half compared nothing
#   g2 (after g and g3; TILES_JSON=<their tiles.json, comma-separated> if their results came back to the repo) C=1
#      and C=64 decode with the sweeps' winners (RLT_LINEAR_TILES, those > 3 % faster than the default) against the
#      default, back to back
#   h  (carrying .whl/fa4b, right after g and g2 on the warm machine) FA4 installed: the FA4 GPU tests, 8K prefill with FA4
#      for prompt rows (dense by default now: `dense0` is RLT_DENSE_PREFILL=0), then C=128 1K/128 end to end with
#      rlt-decode + rlt-prefill composed (2,346 in lease 8, target 2,500)
#   i  (after h, FA4 from /tmp/site) where C=128 1K/128's time goes: its prefill phase (16 x 1K prompts packed into
#      one step budget, under the profiler: GEMM / attention / norms / SwiGLU / other; lease 8: 36 prefill steps of
#      ~82 ms, ~27 ms of each not GEMM by the 8K profile's rates) and its decode step (PROFILE c=128: 8.35 ms per loop
#      step against the 7.06 ms floor) — what the 6.2 % to the 2,500 target would come from; then C=128 end to end
#      at step budgets of 16K (the harness default) and 32K tokens (lease 9 ran the budgets: 2,341 / 2,401)
#   b2 the three fold sites one at a time (RLT_FOLD=attention / split_k / tiles; lease 9: none pays alone)
#   a  the whole GPU suite (SUITE: some of its files); FA4's tests too when h installed it on this machine (/tmp/site) — including, since
#      2026-12-06, test_decode_gpu.py::test_penalised_decode_equals_the_penalised_oracle_fp32 (the penalties'
#      token history on the GPU; never run there yet)
#   d  self-speculation re-measured on this build (scripts/spec_h200.sh: d=1/2, K=2..8, measured acceptance)
#   d2 the chains' new default --self-spec-chain-lag 1 (one step in flight while a chain is open; lease 6 measured
#      --pipeline-depth 1 at +1-7 % for chains) against 2 (the old behaviour: the pipeline's depth) and 0, back to back
# Older calls kept for re-runs: b/bc/c (folds, prefetch: measured slower), e (Triton dense prefill: measured), f
# (device-planned steps: measured). Record everything in $OUT/README.md (device, versions, command, median of three
# after one warm-up); flip a default only on a measured gain.
set -uo pipefail
OUT=${OUT:?set OUT}
CALL=${CALL:?set CALL to one of a..i, at, fh, fs, h200, hs, loop, mk, persist, pf, sp, wd, b2, d2, g2, g3, g4, g5, g6, g7, g8, g9, k128, n, ov, p}
R=$OUT/$CALL
mkdir -p "$R"
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-serve/src:packages/rlt-decode/src:packages/rlt-kvcache/src:packages/rlt-spec/src:packages/rlt-prefill/src:apps/server/src:.
{ python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name(0))"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null; git log --oneline -1; } > "$R/versions.txt"
# The projections' tile / split-plan sweep (benchmarks/decode_kernels.py): sweep TIMEOUT ROWS SHAPES [--tma]
sweep() {
  timeout "$1" python3 -m benchmarks.decode_kernels --parts linear --rows "$2" --sweep-rows "$2" --shapes "$3" \
    "${@:4}" --out "$R/tiles.json" > "$R/tiles.log" 2>&1
  grep -E "^(qkv|gate_up|o_proj|down_proj)" "$R/tiles.log" | tail -8
}
# Sweeps' winners end to end against the default: winners VARIANTS BENCH_TIMEOUT [WORKLOAD [SWEEPS]] (no WORKLOAD:
# decode_h200.sh's C=1 and C=64; SWEEPS: comma-separated tiles.json files, default $R/tiles.json)
winners() {
  TILES=$(python3 -m benchmarks.decode_kernels --tiles-from "${4:-$R/tiles.json}") || exit 1
  echo "RLT_LINEAR_TILES=${TILES:-(none beat the default by 3 %)}" | tee "$R/tiles.txt"
  [ -n "$TILES" ] && SKIP_TESTS=1 TILES="$TILES" VARIANTS="$1" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=$2 \
    ONLY_WORKLOADS="${3:+--workload $3}" OUT=$R bash scripts/decode_h200.sh
}
case $CALL in
  a)
    [ -d /tmp/site/flash_attn ] && export PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
    timeout ${SUITE_TIMEOUT:-540} python3 -m pytest ${SUITE:-tests/gpu} -m gpu -q -p no:cacheprovider -o addopts="" -rfEs \
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
  b2)
    SKIP_TESTS=1 VARIANTS="decode foldattn foldsplitk foldtiles" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=125 \
      OUT=$R bash scripts/decode_h200.sh ;;
  bc)
    SKIP_TESTS=1 VARIANTS="decode fold prefetch foldprefetch" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=110 OUT=$R bash scripts/decode_h200.sh ;;
  c)
    SKIP_TESTS=1 VARIANTS="decode prefetch all" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=170 \
      EXTRA_WORKLOADS="--workload c=128,in=1024,out=128,req=128,budget=35,name=c128-1k" OUT=$R bash scripts/decode_h200.sh ;;
  d)
    OUT=$R bash scripts/spec_h200.sh ;;
  d2)
    for lag in ${LAGS:-2 1 0}; do  # LAGS: a subset when a lease is short
      SKIP_TESTS=1 BENCH_TIMEOUT=150 BENCH_ARGS="--scales 0.002,0.001 --targets 0.92,0.98 --ks 8 --ds 1,2 --big-c 0 --chain-lag $lag" \
        OUT=$R/chainlag$lag bash scripts/spec_h200.sh | tail -12
    done ;;
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
  n)
    SKIP_TESTS=1 VARIANTS="notma decode" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=110 OUT=$R bash scripts/decode_h200.sh ;;
  p)
    SKIP_TESTS=1 VARIANTS="decode prefetch" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=110 OUT=$R bash scripts/decode_h200.sh ;;
  g7)
    TILES=${TILES:-rope_kv:128=128x32x128x4x4x1/1,silu_mul:128=128x64x128x8x3x1/1,split_k:128=128x64x128x4x4x1}
    echo "RLT_LINEAR_TILES=$TILES" | tee "$R/tiles.txt"
    SKIP_TESTS=1 TILES="$TILES" VARIANTS="full fulltiles fullrowstiles" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=100 \
      ONLY_WORKLOADS="--workload c=65,in=1024,out=128,req=65,budget=40,name=c65-1k" OUT=$R bash scripts/decode_h200.sh ;;
  g9)
    sweep 240 64 "o_proj,down_proj" --tma
    winners "decode tiles" 100 c=64,in=1024,out=128,req=64,budget=35,name=c64-1k ;;
  k128)  # K128_PART=a: budget 16K (and C=64 with the decode tiles); b: 32K
    W="--workload ${K128_WORKLOAD:-c=128,in=1024,out=128,req=128,budget=40,name=c128-1k}"
    DT=${DTILES:-decode=64x4x2x0}  # the decode attention tiles before lease 13 (the default: 64x4x3, heads fastest)
    OLD_ROWS=silu_mul=64,split_k=64  # the projection row limits before lease 13 (the default: 96-128 rows fused too)
    if [ "${K128_PART:-a}" = a ]; then
      SKIP_TESTS=1 FUSED_ROWS=$OLD_ROWS DTILES="$DT" VARIANTS="full fullrows fulldtiles" BENCH_ARGS=--no-sync-steps \
        BENCH_TIMEOUT=100 ONLY_WORKLOADS="$W" OUT=$R bash scripts/decode_h200.sh
      [ "${K128_C64:-1}" = 1 ] && SKIP_TESTS=1 DTILES="$DT" VARIANTS="decode dtiles" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=100 \
        ONLY_WORKLOADS="--workload c=64,in=1024,out=128,req=64,budget=35,name=c64-1k" OUT=$R bash scripts/decode_h200.sh
    else  # K128_BUDGETS: "TOKENS:VARIANTS;..." (the default's larger budgets; fullrows at 32K)
      IFS=';' read -ra RUNS <<< "${K128_BUDGETS:-32768:full fullrows;65536:full}"
      for run in "${RUNS[@]}"; do
        SKIP_TESTS=1 FUSED_ROWS=$OLD_ROWS VARIANTS="${run#*:}" BENCH_ARGS="--no-sync-steps --max-num-batched-tokens ${run%%:*}" \
          BENCH_TIMEOUT=100 ONLY_WORKLOADS="$W" OUT=$R/budget${run%%:*} bash scripts/decode_h200.sh
      done
    fi ;;
  sp)  # where an overlapped chain step's time goes against a plain one (C=1, d=2, K=8, a~0.95), torch profiler:
    # the greedy heads fused (RLT_SPEC_FUSED_HEADS=1, the default since lease 14) and not (=0)
    for fused in 1 0; do
      RLT_SPEC_FUSED_HEADS=$fused timeout ${SP_TIMEOUT:-120} python3 -m benchmarks.spec_profile --preset h200 \
        --scales ${SP_SCALE:-0.002} --ks 8 --ds 2 --steps ${SP_STEPS:-64} --out-dir "$R/fused$fused" > "$R/fused$fused.log" 2>&1
      echo "fused heads $fused: rc $?"; head -16 "$R/fused$fused/spec_profile.md"; grep -A12 "^Kernels" "$R/fused$fused/spec_profile.md"
    done ;;
  fs)  # a short lease's fh: the fused heads' GPU test, then sp (the step profiles with and without them)
    timeout 100 python3 -m pytest tests/gpu/test_spec_gpu.py -m gpu -q -p no:cacheprovider -o addopts="" -rfE \
      -k fused_greedy_heads > "$R/gpu-test.log" 2>&1
    echo "test rc $?"; tail -3 "$R/gpu-test.log"
    CALL=sp OUT=$R bash "$0" ;;
  fh)  # the fused greedy heads: their GPU test, then end to end, spec_bench (d = 2, K = 8, a ~0.95 / ~0.98) with them
    # and without, back to back
    timeout 120 python3 -m pytest tests/gpu/test_spec_gpu.py -m gpu -q -p no:cacheprovider -o addopts="" -rfE \
      -k fused_greedy_heads > "$R/gpu-test.log" 2>&1
    echo "test rc $?"; tail -3 "$R/gpu-test.log"
    for fused in 1 0; do
      RLT_SPEC_FUSED_HEADS=$fused SKIP_TESTS=1 BENCH_TIMEOUT=${FH_TIMEOUT:-170} \
        BENCH_ARGS="--scales ${FH_SCALES:-0.002,0.001} --targets ${FH_TARGETS:-0.95,0.98} --ks 8 --ds 2 --big-c 0" OUT=$R/fused$fused \
        bash scripts/spec_h200.sh | tail -9
    done ;;
  ov)  # (any card, ~2 min) benchmarks/row_split_overlap.py: C=64 x 1K rows cut into 2 / 4 groups on parallel streams
    # (one group's projections under another's attention) against one call, CUDA graphs of the engine's loop step
    timeout ${OV_TIMEOUT:-300} python3 -m benchmarks.row_split_overlap --rows ${OV_ROWS:-64} --groups ${OV_GROUPS:-2,4} \
      --out "$R/split.json" > "$R/split.log" 2>&1
    echo "split rc $?"; tail -8 "$R/split.log" ;;
  h200)  # (an H200, ~7-8 min: one call for a short lease) what issue 10 still needs from that card, most wanted first:
    # k128 at a 32K-token budget (C=128 1K/128 end to end: the default against the projection rows before lease 13),
    # C=1 / C=64 decode on today's tree, the persistent-kernel probe (the C=1 projection); then wd at scale 0.01
    # (issue 13's H200 row, closed on H100 numbers) if the call's time allows
    CALL=k128 K128_PART=b K128_BUDGETS="${H200_K128:-32768:full fullrows}" OUT=$R bash "$0" > /dev/null 2>&1
    grep -rh "^  median" "$R/k128" | tail -2
    SKIP_TESTS=1 VARIANTS=decode BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=80 OUT=$R/dec bash scripts/decode_h200.sh > /dev/null 2>&1
    grep -rh "^  median" "$R/dec" | tail -2
    CALL=mk MK_TIMEOUT=45 OUT=$R bash "$0"
    CALL=wd WD_SCALES=0.01 WD_PROF_TIMEOUT=1 OUT=$R bash "$0" ;;
  persist)  # (any card, ~6 min; the first call of the next lease) the persistent_loop feature end to end: the loop
    # probe (kernel vs OuroModel.recurrent and fp32, one loop step timed both ways), the GPU tests (the kernel against
    # recurrent at three shapes; the engine decoding one row through it), then C=1 1K decode with rlt-decode against
    # rlt-decode + --persistent-loop, back to back (and C=64, where nothing should change: the kernel serves one row)
    CALL=loop LOOP_TIMEOUT=${LOOP_TIMEOUT:-180} OUT=$R bash "$0"
    # (a kernel that cannot run traps within its 20 s watchdog; no timing line: the rest would only repeat that)
    grep -q "ms a loop step" "$R/loop/loop.log" || { echo "the loop probe timed no kernel: tests and bench skipped"; exit 0; }
    timeout ${PERSIST_TEST_TIMEOUT:-150} python3 -m pytest tests/gpu/test_persistent_loop_gpu.py -m gpu -q -p no:cacheprovider \
      -o addopts="" -rfEs -s > "$R/gpu-test.log" 2>&1
    echo "gpu test rc $?"; grep -E "passed|failed|^FAILED|^ERROR|kernel vs|bf16 greedy" "$R/gpu-test.log" | tail -12
    # the decode run takes the probe's fastest L2 lookahead (--persistent-loop-l2-ahead)
    AHEAD=$(python3 -c "import json,statistics,sys; v=json.load(open(sys.argv[1]))['variants']; t={int(k.rsplit('l2ahead',1)[1]): statistics.median(e['ms']) for k, e in v.items() if 'l2ahead' in k and 'ms' in e}; print(min(t, key=t.get) if t else 0)" "$R/loop/loop.json" 2>/dev/null || echo 0)
    echo "persist at --persistent-loop-l2-ahead=$AHEAD"
    PERSIST_FLAGS="--feature-flag=--persistent-loop-l2-ahead=$AHEAD" SKIP_TESTS=1 VARIANTS="decode persist" \
      BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=${PERSIST_BENCH_TIMEOUT:-110} OUT=$R bash scripts/decode_h200.sh ;;
  loop)  # (any card, ~2 min) the persistent whole-loop kernel (benchmarks/megakernel/loop.py): its loop output and
    # K/V rows against OuroModel.recurrent (Triton, bf16) and an fp32 copy, then one loop step at C=1 / 1K context,
    # kernel against the kernel-per-op graph, back to back (issue 10's C=1 gap)
    timeout ${LOOP_TIMEOUT:-240} python3 -m benchmarks.megakernel.loop --out "$R/loop.json" ${LOOP_ARGS:-} \
      > "$R/loop.log" 2>&1
    echo "loop rc $?"; grep -vE "^\s*$" "$R/loop.log" | tail -20 ;;
  pf)  # (any card, ~4-5 min) the fused projections at prompt-sized row counts (issue 10's C=128 end to end: prefill is
    # ~40 % of it, 17 % of a prefill step elementwise kernels at their byte floors): benchmarks/prefill_fused_probe.py's
    # launch-shape sweep against cuBLAS + silu_mul / rope_qk_, then the 16 x 1K prefill step (prefill_bench's profile)
    # at the default and with the sweep's best shapes serving every prompt row (RLT_FUSED_ROWS + RLT_LINEAR_TILES)
    timeout ${PF_PROBE_TIMEOUT:-170} python3 -m benchmarks.prefill_fused_probe --out "$R/probe.json" > "$R/probe.log" 2>&1
    echo "probe rc $?"; grep -E "^rows|Error" "$R/probe.log" | tail -6
    PF_TILES=$(python3 - "$R/probe.json" <<'PY'
import json, sys
cases = json.load(open(sys.argv[1]))["cases"]
def best(kind):  # the shape with the least total time over the row counts (every case timed)
    keys = [k for k in cases[0][kind] if all("us" in c[kind].get(k, {}) for c in cases)]
    return min(keys, key=lambda k: sum(c[kind][k]["us"] for c in cases))
print(f"silu_mul:128={best('silu')},rope_kv:128={best('rope')}")
PY
)
    echo "best shapes: $PF_TILES"
    for variant in ${PF_VARIANTS:-default fused default2}; do
      if [ "${variant#fused}" != "$variant" ]; then export RLT_FUSED_ROWS=silu_mul=1048576,rope_kv=1048576 RLT_LINEAR_TILES=$PF_TILES
      else unset RLT_FUSED_ROWS RLT_LINEAR_TILES; fi
      timeout ${PF_TIMEOUT:-90} python3 -m benchmarks.prefill_bench --workload profile --prompt-len 1024 --profile-prompts 16 \
        --out "$R/prefill-16x1k-$variant.json" > "$R/prefill-16x1k-$variant.log" 2>&1
      echo "== $variant rc $?"; python3 -c "import json,sys; r=json.load(open(sys.argv[1]))[0]; print({k: r[k] for k in ('wall_ms_profiled', 'prompt_tok_per_s', 'device_busy_ms', 'ms_by_kind')})" "$R/prefill-16x1k-$variant.json" 2>&1 | tail -1
    done
    unset RLT_FUSED_ROWS RLT_LINEAR_TILES ;;
  wd)  # (any card, ~4-5 min) wide chains (issue 13, docs/spec.md "Wide chains"): their GPU test, then
    # benchmarks/spec_wide.py — C = 1, d = 2, K = 8, --self-spec-width 1 against 4 at loop scales near acceptance 0.8
    timeout ${WD_TEST_TIMEOUT:-150} python3 -m pytest tests/gpu/test_spec_gpu.py -m gpu -q -p no:cacheprovider -o addopts="" \
      -rfE -k "wide_chains or fused_greedy_heads" > "$R/gpu-test.log" 2>&1
    echo "test rc $?"; tail -3 "$R/gpu-test.log"
    timeout ${WD_TIMEOUT:-330} python3 -m benchmarks.spec_wide --scales ${WD_SCALES:-0.01,0.02} --widths ${WD_WIDTHS:-1,4} \
      --out-dir "$R/wide" > "$R/wide.log" 2>&1
    echo "wide rc $?"; tail -12 "$R/wide.log"
    # where a wide chain step's time goes (host wall against device busy), the torch profiler
    timeout ${WD_PROF_TIMEOUT:-120} python3 -m benchmarks.spec_profile --preset h200 --scales 0.002 --ks 8 --ds 2 --steps 64 \
      --width ${WD_PROF_WIDTH:-4} --out-dir "$R/prof" > "$R/prof.log" 2>&1
    echo "profile rc $?"; head -16 "$R/prof/spec_profile.md" ;;
  mk)  # (any card, ~1-2 min) the persistent GEMV-chain probe (benchmarks/megakernel): one Ouro-1.4B loop's weight
    # stream in one kernel, against the same chain as cuBLAS + elementwise kernels in a graph; then C=1 decode
    # (MK_DECODE=1) for the same lease's per-loop-step time
    timeout ${MK_TIMEOUT:-240} python3 -m benchmarks.megakernel.probe --out "$R/megakernel.json" > "$R/megakernel.log" 2>&1
    echo "probe rc $?"; tail -12 "$R/megakernel.log"
    [ "${MK_DECODE:-0}" = 1 ] && SKIP_TESTS=1 VARIANTS=decode BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=90 \
      ONLY_WORKLOADS="--workload c=1,in=1024,out=128,req=1,budget=25,name=c1-1k" OUT=$R bash scripts/decode_h200.sh ;;
  hs)  # the fused heads' launch shapes (benchmarks/spec_heads_sweep.py), then spec_bench d = 2, K = 8 at a ~0.98 with
    # the sweep's best shape against the default, back to back (skipped when the default wins)
    timeout ${HS_TIMEOUT:-150} python3 -m benchmarks.spec_heads_sweep --out "$R/heads.json" > "$R/heads.log" 2>&1
    echo "sweep rc $?"; tail -20 "$R/heads.log"
    BEST=$(python3 -c "import json; d = json.load(open('$R/heads.json')); print(d['best'] if d['best'] != d['default'] else '')")
    [ -n "$BEST" ] && for tiles in "$BEST" ""; do
      RLT_SPEC_HEADS_TILES=$tiles SKIP_TESTS=1 BENCH_TIMEOUT=${FH_TIMEOUT:-170} \
        BENCH_ARGS="--scales 0.001 --targets 0.98 --ks 8 --ds 2 --big-c 0" OUT=$R/tiles${tiles:-default} \
        bash scripts/spec_h200.sh | tail -5
    done ;;
  at)
    timeout 120 python3 -m pytest tests/gpu/test_triton_attention_gpu.py -m gpu -q -p no:cacheprovider -o addopts="" -rfE \
      -k heads_fastest > "$R/heads-fastest-tests.log" 2>&1
    tail -1 "$R/heads-fastest-tests.log"
    timeout 300 python3 -m benchmarks.decode_kernels --parts attention --attention-tiles \
      --attention-cases "${AT_CASES:-64x1024,128x1024,1x1024}" --out "$R/attn.json" > "$R/attn.log" 2>&1
    grep -E "^attention" "$R/attn.log" || tail -5 "$R/attn.log"
    DTILES=$(python3 -m benchmarks.decode_kernels --decode-tiles-from "$R/attn.json" --min-gain 0.02) || exit 1
    echo "RLT_DECODE_TILES=${DTILES:-(none beat the default by 2 %)}" | tee "$R/dtiles.txt"
    [ -z "$DTILES" ] && exit 0
    SKIP_TESTS=1 DTILES="$DTILES" VARIANTS="decode dtiles" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=100 \
      ONLY_WORKLOADS="--workload c=64,in=1024,out=128,req=64,budget=35,name=c64-1k" OUT=$R bash scripts/decode_h200.sh
    [ "${AT_C128:-0}" = 1 ] && SKIP_TESTS=1 DTILES="$DTILES" VARIANTS="full fulldtiles" BENCH_ARGS=--no-sync-steps \
      BENCH_TIMEOUT=100 ONLY_WORKLOADS="--workload c=128,in=1024,out=128,req=128,budget=40,name=c128-1k" \
      OUT=$R bash scripts/decode_h200.sh ;;
  g8)
    sweep 330 1 "qkv+rope+kv,gate_up+silu,o_proj,down_proj" --tma
    winners "decode tiles" 90 c=1,in=1024,out=128,req=1,budget=25,name=c1-1k ;;
  g)
    sweep 540 1,64 "qkv+rope+kv,gate_up+silu" ;;
  g3)
    sweep 540 64 "qkv+rope+kv,gate_up+silu" --tma ;;
  g4)
    sweep 330 1 "qkv+rope+kv,gate_up+silu,o_proj,down_proj" --tma
    SKIP_TESTS=1 VARIANTS="decode splitktma" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=110 \
      ONLY_WORKLOADS="--workload c=1,in=1024,out=128,req=1,budget=25,name=c1-1k" OUT=$R bash scripts/decode_h200.sh ;;
  g5)
    sweep 280 128 "qkv+rope+kv,gate_up+silu,o_proj,down_proj" --tma
    SKIP_TESTS=1 VARIANTS="full fullrows" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=140 \
      ONLY_WORKLOADS="--workload c=128,in=1024,out=128,req=128,budget=40,name=c128-1k" OUT=$R bash scripts/decode_h200.sh ;;
  g6)
    sweep 240 128 "qkv+rope+kv,gate_up+silu,o_proj,down_proj" --tma
    winners "${G6_VARIANTS:-full fullrowstiles fulltiles}" 110 c=128,in=1024,out=128,req=128,budget=40,name=c128-1k ;;
  g2)
    SWEEPS=${TILES_JSON:-$OUT/g/tiles.json,$OUT/g3/tiles.json}
    for f in ${SWEEPS//,/ }; do [ -f "$f" ] || echo "no sweep results at $f"; done
    winners "decode tiles" 250 "" "$SWEEPS" ;;
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
    SKIP_TESTS=1 VARIANTS="${H_VARIANTS:-full}" BENCH_ARGS=--no-sync-steps BENCH_TIMEOUT=${H_TIMEOUT:-150} \
      ONLY_WORKLOADS="--workload c=128,in=1024,out=128,req=128,budget=40,name=c128-1k" OUT=$R bash scripts/decode_h200.sh ;;
  i)
    [ -d /tmp/site/flash_attn ] && export PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
    timeout 200 python3 -m benchmarks.prefill_bench --workload profile --prompt-len 1024 --profile-prompts 16 \
      --out "$R/prefill-16x1k-profile.json" > "$R/prefill-16x1k-profile.log" 2>&1
    python3 -c "import json,sys; r=json.load(open(sys.argv[1]))[0]; print({k: r[k] for k in ('wall_ms_profiled', 'prompt_tok_per_s', 'device_busy_ms', 'ms_by_kind', 'attention')}); print(r['top_kernels_ms'][:8])" "$R/prefill-16x1k-profile.json"
    SKIP_TESTS=1 VARIANTS=none PROFILE="c=128,in=1024" PROFILE_ARGS="--feature-module rlt.decode.feature --disable-feature graphs --disable-feature pipeline" \
      PROFILE_TIMEOUT=200 OUT=$R bash scripts/decode_h200.sh
    for budget in 16384 32768; do  # the step token budget: fewer, fuller prefill steps?
      SKIP_TESTS=1 VARIANTS=full BENCH_ARGS="--no-sync-steps --max-num-batched-tokens $budget" BENCH_TIMEOUT=100 \
        ONLY_WORKLOADS="--workload c=128,in=1024,out=128,req=128,budget=40,name=c128-1k" OUT=$R/budget$budget bash scripts/decode_h200.sh
    done ;;
  *) echo "unknown CALL $CALL"; exit 2 ;;
esac
