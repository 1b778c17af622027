#!/usr/bin/env bash
# Device call 15 on 2x H200 (< 7 min): payloads posted from communication streams (topology.comm_streams).
# Call 14 found the target-bound job (64 anchors, eager padded target) 15% slower with rendezvous sends (27.63 vs
# 32.57 samples/s), its capture 154 instead of 128 ms and every 5 ms grace poll expiring. NCCL starts an operation
# only after the work queued on the stream it was posted from: the drafter's receive, posted from its compute
# stream, began after its queued step; a staged send posted during the next capture waited for that capture.
#   1. bench/transport_check.py (every byte of 200 Qwen3-8B-sized messages, receives allocated while a queued
#      chain still reads the last message): comm streams + rendezvous, comm streams without record_stream (must
#      report corruption, or the check proves nothing), no comm streams;
#   2. the target-bound job of calls 12/14 with comm streams, rendezvous on and off, then comm streams off with
#      rendezvous on (call 14's slow configuration, same machine as the two before).
# Usage: bash bench/gpu_session15.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
transport_checks 60
rendezvous_pair ${PIPE_T:-140} target_bound_comm "${TARGET_BOUND_JOB[@]}" --override topology.comm_streams=true
echo "=== target_bound: comm_streams=false, rendezvous_sends=true at $(el) s"
traced_e2e ${PIPE_T:-150} target_bound_nocomm_rv_true /tmp/pipe_nocomm "${TARGET_BOUND_JOB[@]}" \
  --override topology.comm_streams=false --override topology.rendezvous_sends=true
pack_results
