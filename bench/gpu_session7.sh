#!/usr/bin/env bash
# Seventh device call on 2x H200 (< 10 min):
#   1. the multi-process real job (bench/pipeline.py, e2e part) and the threaded baseline (one process, a target
#      thread on cuda:0, a drafter thread on cuda:1) on the same job and code, one after the other (goal 4);
#   2. in parallel: GPU0 drafter_step on the final default path (compiled loss; inductor's mix-order reduction
#      off on torch < 2.13), GPU1 dflash-plan at SpecForge's config for 2, 4 and 8 GPUs;
#   3. (AUTO=1) the real trainer with topology.target_ranks=auto at SpecForge's config on the two GPUs.
# Usage: bash bench/gpu_session7.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
# the same job for both designs; the target eager (padded, uncompiled) in both, as in the design being replaced,
# so the only compile is the drafter's (in the threaded run: in its thread while the target thread runs)
JOB=(--steps 40 --warmup-steps 10 --override target.packing=off --override target.compile=false)
echo "=== 1a. multi-process real job (1 target + 1 drafter) at $(el) s"
timeout -k 10 ${PIPE_T:-140} python3 bench/pipeline.py --skip-alone --out "$OUT/pipeline_e2e.json" --workdir /tmp/pipe \
  --e2e-timeout $(( ${PIPE_T:-140} - 10 )) "${JOB[@]}" > "$OUT/pipeline_e2e.log" 2>&1
echo "pipeline e2e exit $? at $(el) s"; grep -E "^\|" "$OUT/pipeline_e2e.log" | tail -3
echo "=== 1b. threaded baseline at $(el) s"
timeout -k 10 ${THR_T:-230} python3 bench/threaded_baseline.py --out "$OUT/threaded.json" --workdir /tmp/thr \
  --timeout $(( ${THR_T:-230} - 15 )) --compare "$OUT/pipeline_e2e.json" "${JOB[@]}" > "$OUT/threaded.log" 2>&1
echo "threaded exit $? at $(el) s"; grep -E "^\||compile errors" "$OUT/threaded.log" | tail -8
echo "=== 2. GPU0 drafter_step (the final default path) | GPU1 dflash-plan at $(el) s"
CUDA_VISIBLE_DEVICES=0 timeout -k 10 ${DS_T:-165} python3 bench/drafter_step.py --dynamic on --backends flex_layers \
  --configs 3072x512,550x256 --batch 1,2,4 --time-budget-s 120 --out $OUT/ds.json > $OUT/ds.log 2>&1 &
PA=$!
CUDA_VISIBLE_DEVICES=1 timeout -k 10 ${PLAN_T:-175} python3 -m dflash_dist.plan --gpus 2,4,8 --out $OUT/plan.json \
  target=qwen3_8b_random drafter=dflash drafter.num_anchors=256 data.source=synthetic:550:400 \
  target.max_batch_tokens=4096 target.max_batch_samples=4 train.output_dir=/tmp/plan_run $common > $OUT/plan.log 2>&1
echo "plan exit $? at $(el) s"; wait $PA; echo "drafter_step exit $? at $(el) s"
grep -E "^\|" $OUT/ds.log | tail -8
grep -vE "^W1|Warning|warn" $OUT/plan.log | tail -16
[ -z "${AUTO:-}" ] && exit 0
echo "=== 3. real job, topology.target_ranks=auto at $(el) s"
rm -rf /tmp/auto_run
timeout -k 10 ${AUTO_T:-280} torchrun --standalone --nproc-per-node 2 -m dflash_dist.train target=qwen3_8b_random \
  drafter=dflash drafter.num_anchors=256 data.source=synthetic:550:2000 target.max_batch_tokens=4096 \
  target.max_batch_samples=4 topology.target_ranks=auto train.max_steps=40 logging.log_every=5 \
  train.output_dir=/tmp/auto_run $common 2>&1 | grep -v "^W1" > "$OUT/auto_job.log"
echo "auto job exit ${PIPESTATUS[0]} at $(el) s"
cp /tmp/auto_run/plan.json "$OUT/auto_plan.json" 2>/dev/null
cp /tmp/auto_run/metrics.jsonl "$OUT/auto_metrics.jsonl" 2>/dev/null
grep -iE "split|supply|demand|plan|step 40/|done:|Error" "$OUT/auto_job.log" | tail -14
