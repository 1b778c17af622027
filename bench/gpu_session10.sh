#!/usr/bin/env bash
# Device call 10 on 2x H200 (< 10 min):
#   1. bench/send_overlap.py (GEMM chain) with every scenario: does a pending send still hold the workload back
#      when the workload runs on its own CUDA stream, and does a pending *receive* do the same; once more with
#      CUDA_DEVICE_MAX_CONNECTIONS=32 (more hardware queues: is it a false dependency between streams?);
#   2. goal 4 at SpecForge's config (256 anchors) with the target as in the design being replaced (eager HF
#      forward, padded, uncompiled) in both designs: the real 1 + 1 job, then the threaded baseline.
# Usage: bash bench/gpu_session10.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
for conn in default 32; do
  echo "=== 1. send_overlap gemm, CUDA_DEVICE_MAX_CONNECTIONS=$conn at $(el) s"
  ( [ $conn != default ] && export CUDA_DEVICE_MAX_CONNECTIONS=$conn
    timeout -k 10 ${SO_T:-60} torchrun --standalone --nproc-per-node 2 bench/send_overlap.py --repeats 4 \
      --out $OUT/send_overlap_gemm_conn_$conn.json 2>&1 | grep -v "^W1" > $OUT/send_overlap_gemm_conn_$conn.log )
  echo "exit $? at $(el) s"; grep -E "^\|" $OUT/send_overlap_gemm_conn_$conn.log
done
JOB=(--steps 50 --warmup-steps 15 --override drafter.num_anchors=256 --override target.packing=off
     --override target.compile=false)
echo "=== 2a. multi-process 1 + 1 job, 256 anchors, eager padded target at $(el) s"
traced_e2e ${PIPE_T:-150} pipeline_e2e_256_eager /tmp/pipe "${JOB[@]}"
echo "=== 2b. threaded baseline, same job at $(el) s"
threaded_vs ${THR_T:-230} threaded_256_eager pipeline_e2e_256_eager "${JOB[@]}"
pack_results
