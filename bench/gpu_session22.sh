#!/usr/bin/env bash
# Device call 22 on 2x H200 (< 8 min):
#   1. bench/transport_check.py in its three variants, now connecting the pair first as the trainer does
#      (Channel.connect; call 21: all three hung in the drafter's first payload receive), and once without the
#      connection (--no-connect), which should hang as in call 21 (stack dump after 30 s);
#   2. the evaluation job of call 19 without evaluation (call 19's run ended in its 175 s box during the first
#      compile of a cold machine), for the third row of its table, with TORCH_LOGS=recompiles: why the drafter
#      compiled a planned shape late (step 8) in every job of calls 18-19.
# Usage: bash bench/gpu_session22.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
TRANSPORT_EXTRA="noconnect:--no-connect" transport_checks 45 --hang-s 30
TORCH_LOGS=recompiles eval_job 250 eval_none none 70 25 8 32
grep -B2 -A8 "Recompiling" "$OUT/eval_none_e2e.log" | head -40
pack_results
