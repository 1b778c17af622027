#!/usr/bin/env bash
# Sixth device call on 2x H200 (< 10 min), two parallel lanes:
#   GPU0: bench/flex_tune.py at 3072x512 (inductor autotunes the flex tiles), then drafter_step eager loss vs compiled loss vs
#         flex_layers+ko (the tuned tiles) at 3072x512 (b 1, 2) and 550x256 (b 1, 2, 4)   (goal 2, input of 6);
#   GPU1: target_capture padded vs packed vs packed+compiled on the 550 and 256-3072 mixes (goal 1), then
#         dflash-plan at SpecForge's config for 2, 4 and 8 GPUs (goal 6).
# Usage: bash bench/gpu_session6.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
echo "=== GPU0 flex_tune + drafter_step | GPU1 target_capture + dflash-plan at $(el) s"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout -k 10 ${TUNE_T:-180} python3 bench/flex_tune.py --out $OUT/flex_tune.json > $OUT/flex_tune.log 2>&1
  echo "flex_tune exit $? at $(el) s"
  timeout -k 10 ${DS_T:-300} python3 bench/drafter_step.py --dynamic on --backends flex_layers+eagerloss,flex_layers,flex_layers+ko \
    --kernel-options $OUT/flex_tune.json --configs 3072x512,550x256 --batch 1,2,4 --time-budget-s $(( ${DS_T:-300} - 40 )) \
    --out $OUT/ds.json > $OUT/ds.log 2>&1
  echo "drafter_step exit $? at $(el) s"
) &
PA=$!
(
  export CUDA_VISIBLE_DEVICES=1
  timeout -k 10 ${TC_T:-250} python3 bench/target_capture.py --mixes 550,256-3072 --budgets 16384 --no-full \
    --variants padded,packed,packed_compiled --out $OUT/target_capture.json > $OUT/target_capture.log 2>&1
  echo "target_capture exit $? at $(el) s"
  timeout -k 10 ${PLAN_T:-200} python3 -m dflash_dist.plan --gpus 2,4,8 --out $OUT/plan.json \
    target=qwen3_8b_random drafter=dflash drafter.num_anchors=256 data.source=synthetic:550:400 \
    target.max_batch_tokens=4096 target.max_batch_samples=4 train.output_dir=/tmp/plan_run $common > $OUT/plan.log 2>&1
  echo "plan exit $? at $(el) s"
) &
PB=$!
wait $PA $PB
grep -E "^\||kernel_options" $OUT/flex_tune.log | tail -8
grep -E "^\|" $OUT/ds.log | tail -14
grep -E "^\|" $OUT/target_capture.log | tail -10
grep -vE "^W1|Warning|warn" $OUT/plan.log | tail -16
