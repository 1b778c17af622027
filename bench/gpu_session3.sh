#!/usr/bin/env bash
# Third device call on 2x H200 (< 10 min):
#   1. in parallel: the 0.6B-shaped core job (1 target + 1 drafter, defaults) and the embedded default job;
#   2. in parallel: GPU0 drafter_step flex_layers vs sdpa at 3072x512 and 550x512 (one run: goal 5);
#      GPU1 dflash-plan at SpecForge's config (Qwen3-8B-shaped target, 5-layer drafter, 256 anchors, ~550-token
#      samples, 4-sample messages) for 2, 4 and 8 GPUs (goal 6);
#   3. pipeline efficiency (8B-shaped target + 1B drafter); 4. the threaded baseline on the same job.
# Usage: bash bench/gpu_session3.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
TOTAL=${TOTAL:-560}
proof_jobs ${CORE_T:-150} $OUT   # 1.
echo "=== 2. drafter_step flex_layers vs sdpa (GPU0) + dflash-plan (GPU1) at $(el) s"
CUDA_VISIBLE_DEVICES=0 timeout -k 10 ${DS_T:-120} python3 bench/drafter_step.py --dynamic on \
  --backends flex_layers,sdpa --configs 3072x512,550x512 --out $OUT/ds.json > /tmp/ds.log 2>&1 &
PA=$!
CUDA_VISIBLE_DEVICES=1 timeout -k 10 ${PLAN_T:-150} python3 -m dflash_dist.plan --gpus 2,4,8 --out $OUT/plan.json \
  target=qwen3_8b_random drafter=dflash drafter.num_anchors=256 data.source=synthetic:550:400 \
  target.max_batch_tokens=4096 target.max_batch_samples=4 train.output_dir=/tmp/plan_run $common > $OUT/plan.log 2>&1
echo "plan exit $? at $(el) s"; wait $PA; echo "drafter_step exit $? at $(el) s"
grep -E "^\|" /tmp/ds.log | tail -6; grep -vE "^W1|Warning" $OUT/plan.log | tail -16
pipeline_then_threaded $TOTAL $OUT   # 3. and 4.
