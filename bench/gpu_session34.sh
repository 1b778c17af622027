#!/usr/bin/env bash
# Device call 34 on 2x H200 (< 10 min). Call 33's hybrid jobs spent ~65-95 ms on a message whose row length the
# target had not run before and ~25 ms on one it had (1-sample messages, 550 distinct lengths): the new padded
# capture option target.pad_multiple (rows rounded up to a multiple) and the goal-4 pairs again.
#   1. bench/target_fresh_shapes.py --repeat --profile, padded rows, pad multiples 1 and 64: GPU0 the hybrid target
#      (fla + causal-conv1d) with 1-sample and 4-sample messages, GPU1 the Qwen3-0.6B-shaped dense target (eager);
#   2. call 33's goal-4 pairs with target.pad_multiple at its default (64 for this hybrid on CUDA).
# Usage: bash bench/gpu_session34.sh OUT_DIR     (carry .whl and .carry)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
hybrid_kernels
export PYTHONPATH=/tmp/cc1d:/tmp/fla:$PYTHONPATH
FS=(--variants padded --pad-multiples 1,64 --batches 24 --repeat --profile)
echo "=== 1. fresh shapes: GPU0 hybrid (1- then 4-sample) | GPU1 0.6B dense at $(el) s"
( export CUDA_VISIBLE_DEVICES=0
  for n in 1 4; do
    timeout -k 10 100 python3 bench/target_fresh_shapes.py --target qwen3_next_small "${FS[@]}" --samples-per-batch $n \
      --out "$OUT/fresh_hybrid_b$n.json" > "$OUT/fresh_hybrid_b$n.log" 2>&1; echo "hybrid b$n exit $? at $(el) s"
  done ) &
PA=$!
CUDA_VISIBLE_DEVICES=1 timeout -k 10 150 python3 bench/target_fresh_shapes.py --target qwen3_0p6b_random "${FS[@]}" \
  --samples-per-batch 1 --out "$OUT/fresh_dense_b1.json" > "$OUT/fresh_dense_b1.log" 2>&1; echo "dense exit $? at $(el) s"
wait $PA
grep -hE "^\| padded|top ops" "$OUT"/fresh_*.log | cut -c1-400
pack_one fresh
hybrid_goal4_pairs 140 575
ls "$OUT"
