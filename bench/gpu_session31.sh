#!/usr/bin/env bash
# Device call 31 on 2x H200 (< 10 min): where an anchor group's time goes. Call 30 (drafter-bound 1 + 1 job of
# goal 6's rates): with the last group's loss kept on the drafter, 2 groups gained 1.05x (16.07 vs 15.31
# samples/s) and 4 groups nothing (15.39), although the target served each request in 16-48 ms and sat idle.
# (1) The drafter alone (synthetic features, the job's messages), its anchors in 1, 2, 4 and 8 groups, the loss
#     local: what a group costs; step 40 traced (phase timeline). Two runs at a time, one per GPU.
# (2) The real job with 2 groups, the last one's loss local (m2l1) and both served (m2): drafter step 40 traced.
# Each run's files packed on their own (results_NAME.tgz).
# Usage: bash bench/gpu_session31.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
sed -n '/^JOB=/,/^}$/p;/^run_one() {/,/^}$/p' bench/gpu_session27.sh > /tmp/fns.sh; source /tmp/fns.sh
alone() {  # alone GPU M: the drafter alone, anchors in M groups, step 40 traced
  CUDA_VISIBLE_DEVICES=$1 timeout -k 10 170 python3 bench/pipeline.py --skip-e2e --steps 50 --warmup-steps 20 \
    --alone-timeout 160 --override drafter.num_anchors=256 --override drafter.micro_batches=$2 --profile-step 40 \
    --out "$OUT/alone_m$2.json" --workdir "/tmp/alone_m$2" > "$OUT/alone_m$2.log" 2>&1
  echo "alone m$2 exit $? at $(el) s"; cp "/tmp/alone_m$2/alone_trace_step40.json" "$OUT/alone_m$2_trace.json"
  cp "/tmp/alone_m$2/alone.log" "$OUT/alone_m$2_full.log"
}
for pair in "1 2" "4 8"; do
  set -- $pair
  echo "=== drafter alone, $1 and $2 groups, at $(el) s"
  alone 0 "$1" & p0=$!; alone 1 "$2" & p1=$!; wait $p0 $p1
  for m in "$@"; do
    grep -E "^\| \(a\)" "$OUT/alone_m$m.log"
    grep -E "step 40 \(trace|^\| (group|backward|clip|head)|NCCL" "$OUT/alone_m${m}_full.log" | cut -c1-200
  done
done
( cd "$OUT" && tar czf results_alone.tgz --remove-files alone_* )
OFF=(--override drafter.loss_on_target=true --override drafter.micro_batches=2)
traced_job 40 175 m2l1 "${OFF[@]}" --override drafter.local_loss_groups=1
left=$(( 585 - $(el) )); [ $left -gt 100 ] && traced_job 40 $left m2 "${OFF[@]}"
ls "$OUT"
