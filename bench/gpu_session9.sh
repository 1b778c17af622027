#!/usr/bin/env bash
# Device call 9 on 2x H200 (< 10 min): why the target reads ~100% busy when the drafter sets the pace, and
# the threaded design at SpecForge's config (256 anchors).
#   1. bench/send_overlap.py: does a pending (not yet received) NCCL send slow the sender's compute? a GEMM chain,
#      then the real packed + compiled Qwen3-8B-shaped capture, each alone / with a pending send / after receive;
#   2. the real 1 + 1 job (bench/pipeline.py, e2e part) at 256 anchors, project defaults (packed + compiled
#      target), logging.trace_target=true: per-message stall / capture / backpressure times of the target;
#   3. the threaded baseline on the same job and defaults: the target's compiled capture and the drafter's
#      compiled step traced in two threads of one process (goal 4, and whether that hits compile errors).
# Usage: bash bench/gpu_session9.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
echo "=== 1. send_overlap (gemm, capture) at $(el) s"
timeout -k 10 ${SO_T:-60} torchrun --standalone --nproc-per-node 2 bench/send_overlap.py --out $OUT/send_overlap_gemm.json \
  2>&1 | grep -v "^W1" > $OUT/send_overlap_gemm.log
echo "gemm exit ${PIPESTATUS[0]} at $(el) s"; grep -E "^\||workload|delay" $OUT/send_overlap_gemm.log
timeout -k 10 ${SOC_T:-120} torchrun --standalone --nproc-per-node 2 bench/send_overlap.py --workload capture \
  --out $OUT/send_overlap_capture.json 2>&1 | grep -v "^W1" > $OUT/send_overlap_capture.log
echo "capture exit ${PIPESTATUS[0]} at $(el) s"; grep -E "^\||workload|delay|Error" $OUT/send_overlap_capture.log
JOB=(--steps 50 --warmup-steps 15 --override drafter.num_anchors=256)
echo "=== 2. multi-process 1 + 1 job, 256 anchors, target trace at $(el) s"
traced_e2e ${PIPE_T:-150} pipeline_e2e_256 /tmp/pipe "${JOB[@]}"
echo "=== 3. threaded baseline, same job at $(el) s"
threaded_vs ${THR_T:-220} threaded_256 pipeline_e2e_256 "${JOB[@]}"
pack_results
