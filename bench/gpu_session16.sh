#!/usr/bin/env bash
# Device call 16 on 2x H200 (< 9 min): the drafter's step without host syncs, payloads on communication streams.
# Call 15 showed the drafter's host 92% "busy" with rendezvous sends in the target-bound job: two pageable
# host-to-device copies in make_batch (the anchors' random keys, the sample lengths) synchronized the stream
# every step, so the drafter posted its next receive only after its GPU had finished the step, every 5 ms grace
# poll of the target expired, and the payload waited for the target's next poll. Now: one pinned, non-blocking
# copy each, and the drafter logs the host syncs of one step (CUDA sync debug mode).
#   1. bench/transport_check.py: comm streams, comm streams without record_stream (the check must fail there),
#      no comm streams;
#   2. the target-bound job (calls 12/14/15), rendezvous on and off;
#   3. the drafter-bound job (calls 13/13b: 256 anchors, packed + compiled target), rendezvous on and off;
#   4. if time is left: the in-training evaluation job of call 14, whose drafter rank failed there (its log kept).
# (comm_streams was the default when this ran; it is off now, so the jobs ask for it.)
# Usage: bash bench/gpu_session16.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
transport_checks 50
rendezvous_pair ${PIPE_T:-120} target_bound "${TARGET_BOUND_JOB[@]}" --override topology.comm_streams=true
grep -h "host syncs" "$OUT"/target_bound_rv_*_e2e.log
rendezvous_pair ${PIPE_T:-115} drafter_bound --steps 50 --warmup-steps 15 --override drafter.num_anchors=256 \
  --override topology.comm_streams=true
if [ "$(el)" -lt 470 ]; then
  echo "=== eval job at $(el) s"
  traced_e2e 100 eval_16 /tmp/pipe_eval_16 --steps 30 --warmup-steps 10 --override drafter.num_anchors=256 \
    --override data.source=builtin --override train.eval_prompts=16 --override train.eval_every=10
  grep -E "evaluation at step|acceptance at|Error" "$OUT/eval_16_e2e.log" | head -8
fi
pack_results
