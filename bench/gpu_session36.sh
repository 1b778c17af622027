#!/usr/bin/env bash
# Device call 36 on 2x H200 (< 6.5 min, the session's last device time): goal 4 with the hybrid target once more.
#   1. the hy64 pair a third time (1.39x in call 34, 1.75x in call 35);
#   2. if time is left: the hybrid target with 4-sample messages at 64 anchors (a longer capture per message than
#      1-sample messages, the drafter's step still short): does the ratio hold when the target's ops are larger?
# Usage: bash bench/gpu_session36.sh OUT_DIR     (carry .whl and .carry)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
hybrid_kernels
export PYTHONPATH=/tmp/cc1d:/tmp/fla:$PYTHONPATH
HY=(--target qwen3_next_small --override target.packing=off --override target.compile=false
    --override drafter.num_anchors=64)
goal4_pair 100 90 hy64c "${HY[@]}" --max-batch-samples 1 --steps 300 --warmup-steps 100 --log-every 20
pack_one hy64c
left=$(( ${BUDGET_S:-360} - $(el) ))
[ $left -gt 150 ] && goal4_pair $(( left / 2 )) $(( left / 2 )) hy4x64 "${HY[@]}" --steps 150 --warmup-steps 50 \
  --log-every 10
pack_one hy4x64
ls "$OUT"
