#!/usr/bin/env bash
# Device call 21 on 2x H200 (< 9 min):
#   1. call 20's goal-4 pair again (both roles launch-bound: 0.6B-shaped target eager and padded on 1-sample
#      messages, its drafter at 64 anchors): call 20's multi-process job stopped at its startup check, which took
#      a [1536, 1024] k_proj for a dense score matrix (64 x 16 = 1,024 queries = the kv width), now fixed;
#   2. bench/transport_check.py in its three variants, with stack dumps after 30 s (calls 15-16 printed nothing).
# Usage: bash bench/gpu_session21.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
launch_bound_pair 160 150 tiny_steps --max-batch-samples 1 --override drafter.num_anchors=64 --steps 400 \
  --warmup-steps 100 --log-every 20
transport_checks 45 --hang-s 30
pack_results
