#!/usr/bin/env bash
# One device call on 2x H200 (< 10 min), for issues [1/6], [2/6] and [4/6]:
#   1. the real job, 1 target + 1 drafter over NCCL (Qwen3-0.6B-shaped target, 5-layer flex drafter, ~550-token
#      samples, 4,096-token messages: b varies per step): exit code, samples/s, the startup report (Triton flex
#      kernels) and the compile time with the dynamic-shape flex kernel;
#   2. then in parallel: GPU0 drafter_step (Qwen3-8B shapes) flex and flex_layers with dynamic shapes (the trainer's
#      default); GPU1 drafter_step sdpa, then flex with static shapes (compile time per shape).
# Usage: bash bench/gpu_session.sh OUT_DIR     (carry .whl for hydra/omegaconf)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
CORE_T=${CORE_T:-230}; DS_T=${DS_T:-300}
echo "=== core job (time box ${CORE_T} s) at $(el) s"
RUN=/tmp/core_run
core_job $CORE_T $OUT/core.log $RUN train.max_steps=${CORE_STEPS:-80} ${CORE_EXTRA:-}
echo "core exit $? at $(el) s"; tail -25 $OUT/core.log
cp $RUN/startup_report.json $OUT/ 2>/dev/null; cp $RUN/metrics.jsonl $OUT/core_metrics.jsonl 2>/dev/null
[ -n "${SKIP_DS:-}" ] && exit 0
echo "=== drafter_step at $(el) s (time box ${DS_T} s)"
CUDA_VISIBLE_DEVICES=0 timeout -k 10 $DS_T python3 bench/drafter_step.py --dynamic on --backends flex,flex_layers \
  --out $OUT/ds_dynamic.json --time-budget-s $((DS_T - 60)) > $OUT/ds_dynamic.log 2>&1 &
P0=$!
( CUDA_VISIBLE_DEVICES=1 timeout -k 10 $((DS_T / 2)) python3 bench/drafter_step.py --backends sdpa \
    --out $OUT/ds_sdpa.json --time-budget-s $((DS_T / 2 - 40));
  CUDA_VISIBLE_DEVICES=1 timeout -k 10 $((DS_T / 2)) python3 bench/drafter_step.py --dynamic off --backends flex \
    --configs 3072x512,550x256 --out $OUT/ds_static.json --time-budget-s $((DS_T / 2 - 60)) ) > $OUT/ds_other.log 2>&1
wait $P0
echo "drafter_step done at $(el) s"
for f in ds_dynamic ds_other; do echo "--- $f"; grep -E "^\||skipped|Error|error" $OUT/$f.log | tail -20; done
