export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PYTHONPATH=packages/rlt-platform/src:packages/rlt-attention/src:packages/rlt-decode/src:packages/rlt-prefill/src:apps/server/src:.
[ -n "${FA4:-}" ] && { . scripts/install_carried_wheels.sh .whl/fa4a .whl/fa4b; python3 -c "import flash_attn.cute; print('fa4 ok')" 2>&1 | tail -1; }
timeout 230 python3 -m benchmarks.offline_bench --model ouro-1.4b --dtype bfloat16 --attention-backend triton --work-dir /tmp/rlt-bench \
  --out-dir $OUT/$NAME --reps 3 --warmup-output-len 4 --feature-module rlt.decode.feature --feature-module rlt.prefill.features --no-sync-steps \
  --workload c=128,in=1024,out=128,req=128,budget=35,name=c128-1k > $OUT/$NAME.log 2>&1
grep -E "^\| c128-1k" $OUT/$NAME/results.md || tail -20 $OUT/$NAME.log
grep -iE "attention|fa4|prompt rows" $OUT/$NAME.log | head -5
