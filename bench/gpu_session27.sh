#!/usr/bin/env bash
# Device call 27 on 2x H200 (< 10 min). Calls 25-26: the loss on the target hung in its first step (with the
# staged payloads posted first too); a hung job's processes kept spinning on both GPUs and halved the rate of the
# runs after it in the same call (base 15.49 -> 7.73, "local2" 7.20: not a cost of the anchor groups).
# Here: the offload job once more, with its first head requests logged on both sides, and if it hangs, every
# rank's Python stack (SIGUSR1 -> faulthandler) before it is killed; every leftover process killed after it;
# then base. Usage: bash bench/gpu_session27.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
JOB=(--steps 50 --warmup-steps 20 --override drafter.num_anchors=256)
stacks_if_stuck() {  # stacks_if_stuck SECONDS LOG: dump the ranks' stacks if LOG has no step 5 by then
  sleep "$1"
  if ! grep -q "step 5/" "$2" 2>/dev/null; then echo "no step 5 after $1 s: stacks"; pkill -USR1 -f -- "-u -m dflash_dist.train"; fi
}
run_one() {
  local box=$1 name=$2; shift 2
  echo "=== $name at $(el) s"
  stacks_if_stuck $(( box - 25 )) "/tmp/pipe_$name/e2e.log" & local w=$!
  traced_e2e "$box" "$name" "/tmp/pipe_$name" "${JOB[@]}" "$@"
  kill $w 2>/dev/null; pkill -9 -f dflash_dist.train; sleep 2
  grep -E "head request|lm_head and loss|target (done|stopped)|precompiled|Error|step (1|5|10|50)/" \
    "$OUT/${name}_e2e.log" | grep -v "^frame" | cut -c1-300 | head -14
  grep -B2 -A14 "most recent call first" "$OUT/${name}_e2e.log" | grep -E "File|Thread|Current" | cut -c1-160 | head -60
  grep -oE '"(drafter_mfu|target1_mfu|target1_busy_frac|samples_per_s)": [0-9.e-]*' "$OUT/${name}_metrics.jsonl" | tail -4
}
run_one 175 offload2 --override drafter.loss_on_target=true --override drafter.micro_batches=2
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
run_one 140 base
pack_results
