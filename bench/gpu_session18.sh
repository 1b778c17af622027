#!/usr/bin/env bash
# Device call 18 on 2x H200 (< 6 min) — PREPARED, NOT YET RUN: idle target capacity doing useful work. The
# in-training acceptance evaluation runs on the target rank between messages; the drafter-bound 1 + 1 job on the
# builtin data (it has held-out prompts), 256 anchors, with train.eval_prompts=16 train.eval_every=10, then without
# evaluation: samples/s with / without. In call 14 the drafter rank of both variants failed within 30 s of its
# build, its error not kept; the logs (eval_<n>_e2e.log) and the ranks' error lines (eval_<n>.json) are kept now.
# Usage: bash bench/gpu_session18.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
EVAL=(--steps 40 --warmup-steps 10 --override drafter.num_anchors=256 --override data.source=builtin)
for ev in 16 0; do
  echo "=== eval job, train.eval_prompts=$ev at $(el) s"
  traced_e2e ${PIPE_T:-150} eval_$ev /tmp/pipe_eval_$ev "${EVAL[@]}" --override train.eval_prompts=$ev \
    --override train.eval_every=10
  grep -E "evaluation at step|acceptance at|Error|host syncs" "$OUT/eval_${ev}_e2e.log" | head -8
done
pack_results
