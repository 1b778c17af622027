#!/usr/bin/env bash
# Device call 25 on 2x H200 (< 10 min): the lm_head and loss on the target (drafter.loss_on_target), first GPU run.
# The drafter-bound 1 + 1 job of goal 6's rates (8B-shaped target, packed + compiled; 5-layer drafter, 256 anchors;
# ~550-token synthetic samples in 4-sample messages), rates over steps 20..50, three ways one after the other:
# base (loss on the drafter, one forward per step), offload2 (loss on the target, anchors in 2 groups),
# local2 (loss on the drafter, anchors in 2 groups: what the groups alone cost).
# Usage: bash bench/gpu_session25.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
JOB=(--steps 50 --warmup-steps 20 --override drafter.num_anchors=256)
offload_run() {
  local box=$1 name=$2; shift 2
  echo "=== $name at $(el) s"
  traced_e2e "$box" "$name" "/tmp/pipe_$name" "${JOB[@]}" "$@"
  grep -E "lm_head and loss|head requests served|target (done|stopped)|host syncs|precompiled|Error|error" \
    "$OUT/${name}_e2e.log" | cut -c1-300 | head -12
  grep -oE '"(drafter_mfu|target1_mfu|target1_busy_frac|drafter_wait_frac|samples_per_s)": [0-9.e-]*' \
    "$OUT/${name}_metrics.jsonl" | tail -5
}
offload_run 200 base
offload_run 200 offload2 --override drafter.loss_on_target=true --override drafter.micro_batches=2
left=$(( 585 - $(el) ))
[ $left -gt 120 ] && offload_run $left local2 --override drafter.micro_batches=2
pack_results
