#!/usr/bin/env bash
# Device call 13 on 2x H200 (< 5 min): the drafter-bound job of call 9 (256 anchors, project defaults: packed +
# compiled target) with rendezvous sends (the default since this call), then with topology.rendezvous_sends=false
# (payload sends posted at once, as before), target trace on in both: does the target's capture keep its time
# alone (~50-60 ms) and read as waiting when the drafter sets the pace, and what does it cost the job?
# (Run as two device calls on the same warm machine, 13 and 13b; this script does both.)
# Usage: bash bench/gpu_session13.sh OUT_DIR     (carry .whl)
set -uo pipefail
OUT=${1:-/tmp/gpu_session13}; mkdir -p "$OUT"
source bench/gpu_env.sh
for rv in true false; do
  echo "=== multi-process 1 + 1, 256 anchors, rendezvous_sends=$rv, target trace at $(el) s"
  timeout -k 10 ${PIPE_T:-150} python3 bench/pipeline.py --skip-alone --out "$OUT/pipeline_e2e_256_rv_$rv.json" \
    --workdir /tmp/pipe_$rv --e2e-timeout $(( ${PIPE_T:-150} - 10 )) --steps 50 --warmup-steps 15 \
    --override drafter.num_anchors=256 --override logging.trace_target=true --override topology.rendezvous_sends=$rv \
    > "$OUT/pipeline_e2e_256_rv_$rv.log" 2>&1
  echo "pipeline e2e exit $? at $(el) s"; grep -E "^\| \(b\)" "$OUT/pipeline_e2e_256_rv_$rv.log"
  cp /tmp/pipe_$rv/e2e_run/target_trace/rank1.jsonl "$OUT/target_trace_256_rv_$rv.jsonl" 2>/dev/null
  cp /tmp/pipe_$rv/e2e_run/metrics.jsonl "$OUT/metrics_256_rv_$rv.jsonl" 2>/dev/null
  grep -E "target (done|stopped)" /tmp/pipe_$rv/e2e.log | tail -1
  python3 - "$OUT/target_trace_256_rv_$rv.jsonl" <<'PY' || true
import json, statistics as st, sys
rows = [json.loads(l) for l in open(sys.argv[1])][10:]
print(f"target trace, messages 10..{len(rows) + 9}: " + ", ".join(
    f"{k} median {st.median([r[k] for r in rows]):.1f}" for k in ("stall_ms", "capture_ms", "backpressure_ms")))
PY
done
