#!/usr/bin/env bash
# Device call 17 on 2x H200 (< 9 min) — PREPARED, NOT YET RUN (no device time was left in the session that
# wrote it):
#   1. bench/transport_check.py, which printed nothing within 50-60 s in calls 15-16: now it dumps every thread's
#      stack after --hang-s (a hang names where it waits) and prints progress; comm streams, comm streams without
#      record_stream (must report corruption), no comm streams;
#   2. the target-bound job (calls 12, 14-16), rendezvous on and off, with the drafter's host syncs of call 16
#      reduced to the one in a torch __init__.py (the log now names the project frame behind each sync);
#   3. the drafter-bound job of calls 13/16 with rendezvous sends (the default): rate and host syncs.
# Call 18 (gpu_session18.sh) has the in-training evaluation jobs.
# Usage: bash bench/gpu_session17.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
transport_checks 40 --hang-s 30
rendezvous_pair ${PIPE_T:-125} target_bound "${TARGET_BOUND_JOB[@]}"
grep -h "host syncs" "$OUT"/target_bound_rv_*_e2e.log
echo "=== drafter-bound job (256 anchors, packed + compiled target), rendezvous sends (default) at $(el) s"
traced_e2e ${PIPE_T:-115} drafter_bound_rv /tmp/pipe_db_rv --steps 50 --warmup-steps 15 --override drafter.num_anchors=256
pack_results
