#!/usr/bin/env bash
# Device call 17 on 2x H200 (< 10 min):
#   1. bench/packed_short_rows.py: the packed compiled capture on rows under 128 tokens, the trainer's rule (pad to
#      256) against no padding (the rule of call 14, whose jobs on the builtin corpus died in the target's compile);
#   2. goal 4 on a launch-bound job: Qwen3-0.6B-shaped target (eager, padded, as in the replaced design) + its
#      5-layer drafter (512 anchors), multi-process then threaded, same job;
#   3. the target-bound job of calls 12/14-16 with rendezvous sends on and off, the drafter's step now free of
#      the host syncs call 16 named (the log names any left).
# Usage: bash bench/gpu_session17.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
echo "=== packed short rows at $(el) s"
timeout -k 5 150 python3 bench/packed_short_rows.py --timeout 70 --out "$OUT/short_rows.json" > "$OUT/short_rows.log" 2>&1
echo "exit $?"; grep -E "^\|" "$OUT/short_rows.log"; grep -B2 -A12 "no result" "$OUT/short_rows.log" | head -30
launch_bound_pair 100 100
rendezvous_pair 110 target_bound "${TARGET_BOUND_JOB[@]}"
grep -h "host syncs" "$OUT"/target_bound_rv_*_e2e.log "$OUT"/small_mp_e2e.log
pack_results
