#!/usr/bin/env bash
# Device call 28 on 2x H200 (< 10 min): call 27's offload job again after connecting the head group in both
# directions at startup (the drafter's first reply receive was its first operation from the target on that group:
# NCCL connects a direction on first use and could block there until the target made its own); then base.
# Usage: bash bench/gpu_session28.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
sed -n '/^JOB=/,/^}$/p;/^run_one() {/,/^}$/p' bench/gpu_session27.sh > /tmp/fns.sh; source /tmp/fns.sh
run_one 175 offload2 --override drafter.loss_on_target=true --override drafter.micro_batches=2
run_one 140 base
pack_results
