#!/usr/bin/env bash
# Device call 18 on 2x H200 (< 10 min):
#   1. goal 4 on a launch-bound job (call 17's boxes were too short for its first compile): Qwen3-0.6B-shaped
#      target (eager, padded, as in the replaced design) + its 5-layer drafter (512 anchors), multi-process, then
#      the same job threaded;
#   2. idle target capacity doing useful work: the drafter-bound 1 + 1 job on the builtin corpus (it has held-out
#      prompts; 8B-shaped target, 16-sample messages, 256 anchors), the in-training evaluation (16 prompts every 30
#      steps) run a verify step at a time on the target's waits (train.eval_in_slices=true, the default).
# Run at 243bc4e+1 (37be68d): the evaluation's weights then went over gloo in fp32 (4.2 GB through the host). Call 19
# (gpu_session19.sh) runs a shorter evaluation job three ways, with the weights over NCCL in bf16.
# Usage: bash bench/gpu_session18.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
launch_bound_pair 180 150
eval_job 200 eval_slices true 120 30 16 64
pack_results
