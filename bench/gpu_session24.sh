#!/usr/bin/env bash
# Device call 24 on 2x H200 (< 4 min; its first run, at 5dd2ae9, ran no dry step: the plan was read from a spent generator): call 22's job without evaluation (8B-shaped target, builtin corpus,
# 16-sample messages, 256 anchors, 30 steps) with drafter.precompile (dry steps of the planned batch shapes before
# the first message), TORCH_LOGS=recompiles: no planned shape compiled late (call 22: step 8, 27-34 s).
# Usage: bash bench/gpu_session24.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
TORCH_LOGS=recompiles eval_job 170 precompiled none 30 25 8 32
grep -E "precompiled|compiled the planned|Recompiling|step (1|5|10|15|20)/" "$OUT/precompiled_e2e.log" | cut -c1-220 | head -30
pack_results
