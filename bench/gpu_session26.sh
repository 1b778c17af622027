#!/usr/bin/env bash
# Device call 26 on 2x H200 (< 10 min). Call 25: the loss on the target hung in its first step (the target queued
# a request's receive on its compute stream before posting the payload the drafter needed for that request: now
# posted first) and the anchors in 2 groups halved the drafter's rate with the loss local (7.20 vs 15.49).
# Here: the drafter alone (bench/pipeline.py part (a), the real DrafterTrainer) with 1 and 2 groups, step 12
# profiled (top CUDA kernels by time); then the 1 + 1 job with the loss local (base) and on the target (offload2).
# Usage: bash bench/gpu_session26.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
JOB=(--steps 50 --warmup-steps 20 --override drafter.num_anchors=256)
for m in 1 2; do
  echo "=== drafter alone, micro_batches=$m at $(el) s"
  timeout -k 10 110 python3 bench/pipeline.py --skip-e2e --out "$OUT/alone_m$m.json" --workdir /tmp/alone_m$m \
    --steps 24 --warmup-steps 14 --profile-step 12 --alone-timeout 100 --override drafter.num_anchors=256 \
    --override drafter.micro_batches=$m > "$OUT/alone_m$m.log" 2>&1
  echo "exit $? at $(el) s"; grep -E "^\| \(a\)" "$OUT/alone_m$m.log"
  grep -A16 "top CUDA kernels" /tmp/alone_m$m/alone.log | cut -c1-200
done
offload_run() {
  local box=$1 name=$2; shift 2
  echo "=== $name at $(el) s"
  traced_e2e "$box" "$name" "/tmp/pipe_$name" "${JOB[@]}" "$@"
  grep -E "lm_head and loss|head requests served|target (done|stopped)|host syncs|precompiled|Error|error" \
    "$OUT/${name}_e2e.log" | grep -v "^frame" | cut -c1-300 | head -12
  grep -oE '"(drafter_mfu|target1_mfu|target1_busy_frac|drafter_wait_frac|samples_per_s)": [0-9.e-]*' \
    "$OUT/${name}_metrics.jsonl" | tail -5
}
offload_run 170 offload2 --override drafter.loss_on_target=true --override drafter.micro_batches=2
left=$(( 585 - $(el) ))
[ $left -gt 100 ] && offload_run $left base
pack_results
