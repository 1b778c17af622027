#!/usr/bin/env bash
# Device call 17 on 2x H200 (< 10 min) — PREPARED, NOT YET RUN (no device time was left in the session that
# wrote it):
#   1. bench/transport_check.py, which printed nothing within 50-60 s in calls 15-16: now it dumps every thread's
#      stack after --hang-s (a hang names where it waits) and prints progress; comm streams, comm streams without
#      record_stream (must report corruption), no comm streams;
#   2. the target-bound job (calls 12, 14-16), rendezvous on and off, with the drafter's host syncs of call 16
#      reduced to the one in a torch __init__.py (the log now names the project frame behind each sync);
#   3. the in-training evaluation job of call 14 with and without evaluation (its drafter rank failed in both in
#      call 14; the logs and the ranks' error lines are kept now).
# Usage: bash bench/gpu_session17.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
transport_checks 45 --hang-s 35
rendezvous_pair ${PIPE_T:-125} target_bound "${TARGET_BOUND_JOB[@]}"
grep -h "host syncs" "$OUT"/target_bound_rv_*_e2e.log
EVAL=(--steps 40 --warmup-steps 10 --override drafter.num_anchors=256 --override data.source=builtin)
for ev in 16 0; do
  echo "=== eval job, train.eval_prompts=$ev at $(el) s"
  traced_e2e ${PIPE_T:-110} eval_$ev /tmp/pipe_eval_$ev "${EVAL[@]}" --override train.eval_prompts=$ev \
    --override train.eval_every=10
  grep -E "evaluation at step|acceptance at|Error" "$OUT/eval_${ev}_e2e.log" | head -6
done
pack_results
