#!/usr/bin/env bash
# Device call 32 on 2x H200 (< 8 min, the session's last device time): the loss on the target with each anchor
# group's backward run as soon as its own reply is in (the last reply arrives during the earlier groups' backward)
# and the replies received right before each group's backward on a group of their own (no NCCL receive spinning
# on 16 SMs beside the forward). Call 31's traces: the single backward waited 28 ms for the last reply (2 groups,
# both served) and a pending reply receive slowed the next forward by 27%.
# The drafter-bound 1 + 1 job of goal 6's rates: 2 groups both served (m2), base, 4 groups all served (m4), then
# 2 groups with the last local (m2l1) if time is left. Drafter step 47 traced in each (its window, 45..50, is left
# out of the rate that docs/benchmarks.md gives; the pipeline's own rate includes it).
# Usage: bash bench/gpu_session32.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
sed -n '/^JOB=/,/^}$/p;/^run_one() {/,/^}$/p' bench/gpu_session27.sh > /tmp/fns.sh; source /tmp/fns.sh
OFF=(--override drafter.loss_on_target=true)
traced_job 47 150 m2 "${OFF[@]}" --override drafter.micro_batches=2
traced_job 47 130 base
traced_job 47 150 m4 "${OFF[@]}" --override drafter.micro_batches=4
left=$(( 450 - $(el) )); [ $left -gt 100 ] && traced_job 47 $left m2l1 "${OFF[@]}" --override drafter.micro_batches=2 \
  --override drafter.local_loss_groups=1
ls "$OUT"
