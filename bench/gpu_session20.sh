#!/usr/bin/env bash
# Device call 20 on 2x H200 (run; 213 s; the multi-process job of part 1 stopped at its startup check: see call 21):
#   1. goal 4 where BOTH roles are launch-bound: the 0.6B-shaped target eager and padded on 1-sample messages
#      (~550 tokens), its 5-layer drafter at 64 anchors; multi-process then threaded, 400 steps, rates over
#      steps 100..400 (calls 7-18 measured five configurations where at least one role was compute-bound);
#   2. bench/eval_step.py: where a verify step of the in-training evaluation goes (65-97 ms in call 19 on the
#      8B-shaped target): a whole slice, the target's verify forward alone, the draft step alone; fp32 and bf16
#      evaluator drafter.
# Usage: bash bench/gpu_session20.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
launch_bound_pair 170 170 tiny_steps --max-batch-samples 1 --override drafter.num_anchors=64 --steps 400 \
  --warmup-steps 100 --log-every 20
echo "=== eval_step at $(el) s"
timeout -k 5 150 python3 bench/eval_step.py --out "$OUT/eval_step.json" > "$OUT/eval_step.log" 2>&1
echo "exit $?"; grep -E "^\|" "$OUT/eval_step.log"
pack_results
