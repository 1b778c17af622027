#!/usr/bin/env bash
# Device call 30 on 2x H200 (< 10 min), prepared in session 8, run in session 9.
# What a served head request costs by chunk height and compile (bench/head_serve.py: call 28 measured 45 ms =
# 425 TFLOP/s per 7,680-row request inside the job), then call 29's unfinished runs with boxes long enough to
# compile their new group shapes: the last group's loss kept on the drafter (drafter.local_loss_groups=1) with
# 2 groups and with 4, and base, one after the other (leftover ranks killed after each run).
# Usage: bash bench/gpu_session30.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
sed -n '/^JOB=/,/^}$/p;/^run_one() {/,/^}$/p' bench/gpu_session27.sh > /tmp/fns.sh; source /tmp/fns.sh
echo "=== head_serve at $(el) s"
timeout -k 10 75 python3 bench/head_serve.py --rows 3840,7680 --chunk-rows 2048,4096,8192 --out "$OUT/head_serve.json" > "$OUT/head_serve.log" 2>&1
echo "exit $? at $(el) s"; grep -E "^\|" "$OUT/head_serve.log"
OFF=(--override drafter.loss_on_target=true --override drafter.local_loss_groups=1)
run_one 175 m2l1 "${OFF[@]}" --override drafter.micro_batches=2; pack_one m2l1
run_one 205 m4l1 "${OFF[@]}" --override drafter.micro_batches=4; pack_one m4l1
left=$(( 585 - $(el) )); [ $left -gt 95 ] && { run_one $left base; pack_one base; }
ls "$OUT"
