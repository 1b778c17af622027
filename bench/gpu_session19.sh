#!/usr/bin/env bash
# Device call 19 on 2x H200 (< 8 min): the evaluation job of call 18 (gpu_session18.sh part 2) without evaluation,
# then with each evaluation run whole between two messages (train.eval_in_slices=false): samples/s of the three.
# Usage: bash bench/gpu_session19.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
eval_job 170 eval_none none
eval_job 220 eval_whole false
pack_results
