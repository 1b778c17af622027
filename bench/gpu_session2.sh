#!/usr/bin/env bash
# Second device call on 2x H200 (< 10 min):
#   1. in parallel: the 0.6B-shaped core job (1 target + 1 drafter, compiled layers + dynamic flex, the defaults)
#      and the embedded default job (tiny target, builtin data, in-training evaluation) on the GPUs;
#   2. drafter_step at Qwen3-8B shapes: GPU0 flex_layers (the trainer's default) at 4 configs with a profiled
#      step-time breakdown at 3072x512, then the checkpointed loss at 3072x512; GPU1 flex without compiled layers;
#   3. pipeline efficiency (8B-shaped target + 1B drafter: drafter alone vs the real 1+1 job);
#   4. the threaded baseline on the same job with what time is left.
# Usage: bash bench/gpu_session2.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
TOTAL=${TOTAL:-575}
proof_jobs ${CORE_T:-170} $OUT   # 1.
echo "=== 2. drafter_step at $(el) s"
DS_T=${DS_T:-160}
( CUDA_VISIBLE_DEVICES=0 timeout -k 10 $DS_T python3 bench/drafter_step.py --dynamic on --backends flex_layers \
    --profile 3072x512 --out $OUT/ds_a.json --time-budget-s $((DS_T - 40));
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 60 python3 bench/drafter_step.py --dynamic on --backends flex_layers \
    --configs 3072x512 --loss-mode checkpoint --out $OUT/ds_ckpt.json ) > $OUT/ds.log 2>&1 &
PA=$!
CUDA_VISIBLE_DEVICES=1 timeout -k 10 $DS_T python3 bench/drafter_step.py --dynamic on --backends flex \
    --configs 3072x512,550x256 --out $OUT/ds_b.json >> $OUT/ds_b.log 2>&1
wait $PA; cat $OUT/ds_b.log >> $OUT/ds.log; rm -f $OUT/ds_b.log
python3 - $OUT/ds_ckpt.json $OUT/ds_a.json <<'PY'
import json, sys
try:
    c = json.load(open(sys.argv[1])); a = json.load(open(sys.argv[2]))
    a["rows"] += [dict(r, backend=r["backend"] + "+ckpt_loss") for r in c["rows"]]
    json.dump(a, open(sys.argv[2], "w"), indent=1)
except Exception as e:
    print("merge:", e)
PY
rm -f $OUT/ds_ckpt.json
grep -E "^\||ms/step|breakdown|top kernels" $OUT/ds.log | tail -40
pipeline_then_threaded $TOTAL $OUT   # 3. and 4.
