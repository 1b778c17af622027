#!/usr/bin/env bash
# Device call 12 on 2x H200 (< 10 min), one configuration where the target's speed matters: 64 anchors per
# sample (the drafter step ~4x lighter than at 256), ~550-token samples, 4-sample messages, the target as in the
# design being replaced (eager HF forward, padded, uncompiled) everywhere, 120 steps, rate over steps 20..120:
#   1. the real 1 + 1 job with rendezvous sends (the default: a payload send is posted once the drafter has
#      posted its receive), target trace on;
#   2. the same job with topology.rendezvous_sends=false (sends posted at once, as before), target trace on;
#   3. the threaded baseline on the same job (goal 4).
# Usage: bash bench/gpu_session12.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
JOB=("${TARGET_BOUND_JOB[@]}")
rendezvous_pair ${PIPE_T:-140} pipeline_e2e "${JOB[@]}"
echo "=== 3. threaded baseline, same job at $(el) s"
threaded_vs ${THR_T:-200} threaded pipeline_e2e_rv_true "${JOB[@]}"
pack_results
