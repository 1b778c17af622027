#!/usr/bin/env bash
# Device call 33 on 2x H200 (< 10 min): goal 4 (multi-process / threaded) with a hybrid GatedDeltaNet target, the
# seventh configuration. The reduced Qwen3-Next-shaped target (conf/target/qwen3_next_small.yaml: 12 layers, 9
# GatedDeltaNet + 3 gated attention, hidden 1024) runs fla's Triton kernels and causal-conv1d, launched from
# Python: the most Python-heavy target the project supports, padded and eager in both designs (packing is refused
# for linear-attention layers). Its 5-layer drafter (hidden 1024) compiled with flex in both.
#   1. hy512: 4-sample messages of ~550-token samples, 512 anchors;
#   2. hy64: 1-sample messages, 64 anchors (both roles short and launch-bound), if time is left.
# Usage: bash bench/gpu_session33.sh OUT_DIR     (carry .whl and .carry)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
hybrid_kernels
export PYTHONPATH=/tmp/cc1d:/tmp/fla:$PYTHONPATH
HY=(--target qwen3_next_small --override target.packing=off --override target.compile=false)
goal4_pair 150 150 hy512 "${HY[@]}" --steps 100 --warmup-steps 30
pack_one hy512
left=$(( 570 - $(el) ))
[ $left -gt 160 ] && goal4_pair $(( left / 2 )) $(( left / 2 )) hy64 "${HY[@]}" --max-batch-samples 1 \
  --override drafter.num_anchors=64 --steps 300 --warmup-steps 100 --log-every 20
pack_one hy64
ls "$OUT"
