#!/usr/bin/env bash
# Device call 35 on 2x H200 (< 9 min): goal 4 again, target.pad_multiple now 64 on CUDA for every padded capture.
#   1. call 34's hy64 pair once more (hybrid target with fla + causal-conv1d, 1-sample messages, 64 anchors):
#      1.39x in call 34, one run each;
#   2. call 21's pair (Qwen3-0.6B-shaped dense target, eager padded, 1-sample messages, 64 anchors, 1.08x then)
#      with the padded rows now rounded to 64 tokens (call 34: 70 -> 40 ms per new-length capture).
# Usage: bash bench/gpu_session35.sh OUT_DIR     (carry .whl and .carry)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
hybrid_kernels
export PYTHONPATH=/tmp/cc1d:/tmp/fla:$PYTHONPATH
goal4_pair 100 95 hy64b --target qwen3_next_small --override target.packing=off --override target.compile=false \
  --max-batch-samples 1 --override drafter.num_anchors=64 --steps 300 --warmup-steps 100 --log-every 20
pack_one hy64b
left=$(( 530 - $(el) ))
launch_bound_pair $(( left / 2 )) $(( left / 2 )) dense64 --max-batch-samples 1 --override drafter.num_anchors=64 \
  --steps 400 --warmup-steps 100 --log-every 20
pack_one dense64
ls "$OUT"
