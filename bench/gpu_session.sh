#!/usr/bin/env bash
# The one device call of a session (2x H200, < 10 min): issue [2/6] checks (doctor, hybrid fast-path policy)
# and the issue [4/6] benchmarks (drafter step, target capture, hybrid with/without causal-conv1d, pipeline
# efficiency with the real job's startup report). Usage: bash bench/gpu_session.sh OUT_DIR
set -uo pipefail
OUT=${1:-/tmp/gpu_session}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
DOCTOR_T=60 B1_T=40 B2_T=70 PARTS="A B" bash bench/gpu_checks.sh "$OUT" 2>&1 | tee "$OUT/checks.log" | tail -60
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
B_DRAFTER=${B_DRAFTER:-170} B_TARGET=80 B_HYBRID=45 B_PIPE=${B_PIPE:-190} SKIP_THREADED=1 bash bench/run_all_gpu.sh "$OUT" 2>&1 | tail -80
