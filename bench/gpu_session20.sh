#!/usr/bin/env bash
# Device call 20 on 2x H200 (< 9 min) — PREPARED, NOT YET RUN (no device time was left in the session that wrote it):
#   1. bench/eval_step.py: where a verify step of the in-training evaluation goes (65-97 ms in call 19 on the
#      8B-shaped target): a whole slice, the target's verify forward alone, the draft step alone; fp32 and bf16
#      evaluator drafter;
#   2. the evaluation job of call 19 without evaluation (call 19's run ended in its 175 s box during the first
#      compile of a cold machine), for the third row of its table, with TORCH_LOGS=recompiles: why the drafter
#      compiled a planned shape late (step 8) in every job of calls 18-19;
#   3. bench/transport_check.py in its three variants, with stack dumps after 30 s (calls 15-16 printed nothing).
# Usage: bash bench/gpu_session20.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
echo "=== eval_step at $(el) s"
timeout -k 5 150 python3 bench/eval_step.py --out "$OUT/eval_step.json" > "$OUT/eval_step.log" 2>&1
echo "exit $?"; grep -E "^\|" "$OUT/eval_step.log"
TORCH_LOGS=recompiles eval_job 240 eval_none none 70 25 8 32
grep -A6 "Recompiling" "$OUT/eval_none_e2e.log" | head -30
transport_checks 40 --hang-s 30
pack_results
