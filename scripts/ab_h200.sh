#!/usr/bin/env bash
# Old vs new engine code back to back in one device lease (decode at C=1 and C=64, Ouro-1.4B
# shapes, bf16, 1K-token prompts, Triton attention), alternating old/new twice so lease drift shows:
#
#   OLD=.abtree/old OUT=benchmarks/results/<dir> bash scripts/ab_h200.sh
#
# OLD is a tree holding packages/, apps/ and benchmarks/*.py of the older commit (git archive).
set -uo pipefail
OUT=${OUT:?set OUT}
OLD=${OLD:?set OLD}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
run() {  # run <label> <tree>
  local tree=$1 label=$2
  ( cd "$tree" && PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:apps/server/src:. \
    timeout 300 $PY -m benchmarks.offline_bench --model ouro-1.4b --dtype bfloat16 --attention-backend triton \
      --work-dir /tmp/rlt-bench --out-dir "$OLDPWD/$OUT/$label" --reps 3 --warmup-output-len 4 \
      --workload c=1,in=1024,out=128,req=1,budget=25,name=c1-1k \
      --workload c=64,in=1024,out=128,req=64,budget=35,name=c64-1k ) > "$OUT/$label.log" 2>&1
  grep -E "c1-1k|c64-1k" "$OUT/$label.log" | tail -4
}
for round in 1 2; do
  echo "== round $round: old"; run "$OLD" "old-$round"
  echo "== round $round: new"; run . "new-$round"
done
