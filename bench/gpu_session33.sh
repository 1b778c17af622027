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
hybrid_goal4_pairs 150 570 --override target.pad_multiple=1   # as run: before target.pad_multiple (call 34)
ls "$OUT"
