#!/usr/bin/env bash
# The H200 performance baseline for Ouro-1.4B shapes (random weights, bf16), in one command:
#
#   OUT=benchmarks/results/h200-$(date +%Y%m%d) bash scripts/bench_h200.sh
#
# Run from the repository root on a CUDA machine (python3 with torch; Triton optional). Steps:
#   1. probe the Triton attention backend in its own process (benchmarks/probe_backend.py: fp32
#      greedy tokens identical to the torch backend); use it if the probe passes, else torch;
#   2. the offline harness: C=1 / 32 / 64 / 128 at 1K in / 128 out, C=16 at 4K in, one 8K-token
#      prefill, C=64 with adaptive depth (tau=0.7 on the random gate), the eager baselines, and
#      torch-profiler views of C=1 and C=64 decode steps.
# Writes results.json, results.md, profile.json, profile_summary.md, log.txt, probe.txt and
# nvidia-smi.txt into $OUT. MODELS="ouro-2.6b nanbeige4.2-3b huginn-0125 huginn-0125-r4" runs C=1, C=64
# decode and an 8K prefill for each named model instead. FEATURES adds feature packages to every run
# (default: none, the base engine), e.g. FEATURES="--feature-module rlt.decode.feature --no-sync-steps"
# for rlt-decode (what scripts/decode_h200.sh runs; the pipeline needs --no-sync-steps to overlap).
# FIXED_DEPTH=1 runs only the headline workloads with --fixed-depth (auto may
# then choose FlashAttention, e.g. FA4 when its wheels are installed; Triton is the fallback).
#
# Sizing (what was cut to fit a ~5-minute device slot; each cut is recorded in results.json):
#   * requests = C (one closed-loop round) instead of 2*C for every workload;
#   * each workload has a time budget (budget=s): when the warm-up predicts that three
#     repetitions do not fit, fewer run (at least one), then fewer output tokens;
#   * KV: C=128 x 1151 positions x 4 depth planes x 196,608 B = 108 GiB — it fits next to the
#     weights on a 140 GiB H200 with a Triton backend; the harness shrinks C (recorded) if the
#     pool plus the backend's temporaries would not fit free memory (the torch backend pads
#     every row of a mixed prefill step to the longest prompt and needs tens of GiB more).
set -uo pipefail
OUT=${OUT:-benchmarks/results/h200-$(date +%Y%m%d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-decode/src:packages/rlt-prefill/src:apps/server/src:.${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
T0=$(date +%s)

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi unavailable" > "$OUT/nvidia-smi.txt"
head -12 "$OUT/nvidia-smi.txt"

BACKEND=${RLT_BENCH_BACKEND:-}
if [ -z "$BACKEND" ]; then
  if timeout 180 $PY -m benchmarks.probe_backend --backend triton > "$OUT/probe.txt" 2>&1; then
    BACKEND=auto
  else
    BACKEND=torch
  fi
  tail -3 "$OUT/probe.txt"
fi
echo "attention backend for the run: $BACKEND (probe took $(( $(date +%s) - T0 )) s)"

COMMON=(--model ouro-1.4b --dtype bfloat16 --attention-backend "$BACKEND" --work-dir /tmp/rlt-bench --out-dir "$OUT"
        --reps 3 --warmup-output-len 4
        --workload c=1,in=1024,out=128,req=1,budget=25,name=c1-1k)
if [ -n "${MODELS:-}" ]; then
  # The other families (issue 14): C=1 and C=64 decode and one 8K prefill per named model, each
  # into $OUT/<model>/ (MODELS="ouro-2.6b nanbeige4.2-3b huginn-0125 huginn-0125-r4", or a subset).
  rc=0
  for m in $MODELS; do
    $PY -m benchmarks.offline_bench --model "$m" --dtype bfloat16 --attention-backend "$BACKEND" --work-dir /tmp/rlt-bench \
      --out-dir "$OUT/$m" --reps 3 --warmup-output-len 4 --fallback-backend torch ${FEATURES:-} \
      --workload c=1,in=1024,out=128,req=1,budget=${MODEL_BUDGET:-20},name=c1-1k \
      --workload c=64,in=1024,out=128,req=64,budget=${MODEL_BUDGET:-20},name=c64-1k \
      --workload c=1,in=8192,out=1,req=1,budget=15,name=prefill-8k > "$OUT/$m.log" 2>&1 || rc=1
    echo "== $m"; grep -E "^\| (c1-1k|c64-1k|prefill-8k) " "$OUT/$m/results.md" || tail -5 "$OUT/$m.log"
    rm -rf /tmp/rlt-bench/"$m"*  # the next model's checkpoint needs the disk
  done
  echo "bench_h200.sh: exit $rc after $(( $(date +%s) - T0 )) s; results in $OUT"
  exit "$rc"
fi
if [ "${FIXED_DEPTH:-0}" = 1 ]; then
  # Fixed-depth serving (EngineConfig.fixed_depth): auto may choose FlashAttention for LAST_EXITED.
  # The headline workloads only; the baselines and profiles do not depend on it.
  RUN=(--fixed-depth --fallback-backend triton
       --workload c=64,in=1024,out=128,req=64,budget=35,name=c64-1k
       --workload c=128,in=1024,out=128,req=128,budget=40,name=c128-1k
       --workload c=1,in=8192,out=1,req=1,budget=15,name=prefill-8k)
else
  RUN=(--fallback-backend torch
       --workload c=32,in=1024,out=128,req=32,budget=25,name=c32-1k
       --workload c=64,in=1024,out=128,req=64,budget=35,name=c64-1k
       --workload c=128,in=1024,out=128,req=128,budget=40,name=c128-1k
       --workload c=16,in=4096,out=128,req=16,budget=30,name=c16-4k
       --workload c=1,in=8192,out=1,req=1,budget=15,name=prefill-8k
       --workload c=64,in=1024,out=128,req=64,tau=0.7,budget=20,name=c64-1k-adaptive
       --baseline reference:c=1,in=1024,out=4
       --baseline dense:c=1,in=1024,out=32
       --baseline dense:c=64,in=1024,out=32
       --profile c=1,in=1024 --profile c=64,in=1024)
fi
$PY -m benchmarks.offline_bench "${COMMON[@]}" "${RUN[@]}" ${FEATURES:-} 2>&1 | tee "$OUT/log.txt"
rc=${PIPESTATUS[0]}
echo "bench_h200.sh: exit $rc after $(( $(date +%s) - T0 )) s; results in $OUT"
exit "$rc"
