#!/usr/bin/env bash
# Device call 23 on 2x H200 (< 6 min):
#   1. bench/transport_check.py in its three variants with a 100-matmul chain before each digest (call 22: with
#      12 the no-record_stream variant read 0 corrupted, so the check had not shown that it can fail);
#   2. the proof jobs with the trainer's new startup connection (Channel.connect): the core job (random-init
#      0.6B-shaped target, whose head weights go first) and the embedded default (tiny target from its local
#      files, no head weights sent, in-training evaluation), both jobs on the two GPUs at once.
# Usage: bash bench/gpu_session23.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
transport_checks 45 --hang-s 30 --slow-matmuls 100
proof_jobs 200 "$OUT"
pack_results
