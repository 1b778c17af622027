#!/usr/bin/env bash
# Device call 14 on 2x H200 (< 10 min; prepared in one session, run as call 14 in the next: results *_call14.*;
# its parts were rehearsed on CPU with --tiny):
#   1. the target-bound job of call 12 (64 anchors, eager padded target, 120 steps) with rendezvous sends, now
#      with the 5 ms grace poll after each header, then with rendezvous_sends=false: samples/s (call 12 without
#      the grace poll: 33.03 vs 33.69) and the drafter's wait fraction (0.5-0.9% there: hidden in its GPU stream);
#   2. idle target capacity doing useful work: the in-training acceptance evaluation runs on the target rank
#      between messages. The 1 + 1 job on the builtin data (it has held-out prompts), 256 anchors, with
#      train.eval_prompts=16 train.eval_every=10, then without evaluation: samples/s with / without.
# Usage: bash bench/gpu_session14.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
rendezvous_pair ${PIPE_T:-140} target_bound "${TARGET_BOUND_JOB[@]}"
EVAL=(--steps 50 --warmup-steps 15 --override drafter.num_anchors=256 --override data.source=builtin)
for ev in 16 0; do
  echo "=== 2. drafter-bound 1 + 1 on builtin data, train.eval_prompts=$ev at $(el) s"
  traced_e2e ${PIPE_T:-130} eval_$ev /tmp/pipe_eval_$ev "${EVAL[@]}" --override train.eval_prompts=$ev \
    --override train.eval_every=10
  grep -E "evaluation at step" /tmp/pipe_eval_$ev/e2e.log | tail -4
done
pack_results
