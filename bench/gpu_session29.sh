#!/usr/bin/env bash
# Device call 29 on 2x H200 (< 6 min, the session's last device time): call 28's job (1.06x with both groups'
# loss on the target: the target serves a group in ~45 ms, so the drafter's single backward waited ~60 ms per step)
# with the last anchor group's loss kept on the drafter (drafter.local_loss_groups=1): 4 groups (3 served) and
# 2 groups (1 served), and base in the same call. Each run's files packed on their own (results_NAME.tgz).
# Usage: bash bench/gpu_session29.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
sed -n '/^JOB=/,/^}$/p;/^run_one() {/,/^}$/p' bench/gpu_session27.sh > /tmp/fns.sh; source /tmp/fns.sh
OFF=(--override drafter.loss_on_target=true --override drafter.local_loss_groups=1)
run_one 115 m4l1 "${OFF[@]}" --override drafter.micro_batches=4; pack_one m4l1
run_one 105 base; pack_one base
left=$(( 330 - $(el) )); [ $left -gt 95 ] && { run_one $left m2l1 "${OFF[@]}" --override drafter.micro_batches=2; pack_one m2l1; }
ls "$OUT"
