#!/usr/bin/env bash
# Device call 19 on 2x H200 (< 10 min): idle target capacity doing useful work, measured. The drafter-bound 1 + 1 job
# on the builtin corpus (8B-shaped target, 16-sample messages, 256 anchors, 70 steps), three ways, rates over steps
# 20..70: no evaluation; the in-training evaluation (8 held-out prompts x 32 new tokens, every 25 steps) a verify
# step at a time on the target's waits (train.eval_in_slices=true, the default); the same evaluation run whole
# between two messages (false). The weights go leader -> first target over NCCL in bf16 (group `evals`).
# Usage: bash bench/gpu_session19.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
eval_job 175 eval_none none 70 25 8 32
eval_job 175 eval_slices true 70 25 8 32
eval_job 175 eval_whole false 70 25 8 32
pack_results
