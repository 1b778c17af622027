#!/usr/bin/env bash
# Fifth device call on 2x H200 (< 10 min):
#   1. in parallel: GPU1 dflash-plan at SpecForge's config (Qwen3-8B-shaped target, 5-layer drafter, 256 anchors,
#      ~550-token samples, 4-sample messages) for 2, 4 and 8 GPUs (goal 6);
#      GPU0 bench/flex_tune.py at 3072x512, then drafter_step flex_layers vs flex_layers+ko (the tuned tiles) at
#      3072x512 and 550x256, batch 1 and 2 (goal 2);
#   2. pipeline efficiency (8B-shaped target + 1B drafter: drafter alone, then the real 1+1 job) (goal 3).
# Usage: bash bench/gpu_session5.sh OUT_DIR     (carry .whl; SKIP_PIPELINE=1: part 1 only)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
echo "=== 1. flex_tune + drafter_step (GPU0) | dflash-plan (GPU1) at $(el) s"
(
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 ${TUNE_T:-170} python3 bench/flex_tune.py --out $OUT/flex_tune.json \
    > $OUT/flex_tune.log 2>&1
  echo "flex_tune exit $? at $(el) s"
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 ${DS_T:-170} python3 bench/drafter_step.py --dynamic on \
    --backends flex_layers,flex_layers+ko --kernel-options $OUT/flex_tune.json --configs 3072x512,550x256 \
    --batch 1,2 --out $OUT/ds.json > $OUT/ds.log 2>&1
  echo "drafter_step exit $? at $(el) s"
) &
PA=$!
CUDA_VISIBLE_DEVICES=1 timeout -k 10 ${PLAN_T:-170} python3 -m dflash_dist.plan --gpus 2,4,8 --out $OUT/plan.json \
  target=qwen3_8b_random drafter=dflash drafter.num_anchors=256 data.source=synthetic:550:400 \
  target.max_batch_tokens=4096 target.max_batch_samples=4 train.output_dir=/tmp/plan_run $common > $OUT/plan.log 2>&1
echo "plan exit $? at $(el) s"; wait $PA
grep -vE "^W1|Warning|warn" $OUT/plan.log | tail -14
grep -E "^\||kernel_options" $OUT/flex_tune.log | tail -8
grep -E "^\|" $OUT/ds.log | tail -10
[ -n "${SKIP_PIPELINE:-}" ] && exit 0
TOTAL=${TOTAL:-575}
left=$(( TOTAL - $(el) ))
echo "=== 2. pipeline at $(el) s (${left} s left)"
timeout -k 10 $(( left - 5 )) python3 bench/pipeline.py --out "$OUT/pipeline.json" --workdir /tmp/pipe --steps 40 \
  --warmup-steps 10 --alone-timeout $(( left * 42 / 100 )) --e2e-timeout $(( left * 50 / 100 )) > "$OUT/pipeline.log" 2>&1
echo "pipeline exit $? at $(el) s"; grep -E "^\|" "$OUT/pipeline.log" | tail -5
