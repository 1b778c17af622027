#!/usr/bin/env bash
# Fourth (short) device call on 2x H200: the real job at HEAD, three runs at once on the two GPUs (proof runs,
# not timings): the 0.6B-shaped core job with the defaults, the same with drafter.compile_layers=true, and the
# embedded default job (tiny target, builtin data, in-training evaluation). Usage: bash bench/gpu_session4.sh OUT
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
T=${T:-150}
core_job $T $OUT/core.log /tmp/core train.max_steps=60 &
P1=$!
core_job $T $OUT/core_compiled_layers.log /tmp/core_cl train.max_steps=60 drafter.compile_layers=true &
P2=$!
default_job $T $OUT/default.log /tmp/default &
P3=$!
wait $P1; echo "core exit $? at $(el) s"; wait $P2; echo "core compile_layers exit $? at $(el) s"; wait $P3; echo "default exit $? at $(el) s"
cp /tmp/core/startup_report.json $OUT/ 2>/dev/null; cp /tmp/core/metrics.jsonl $OUT/core_metrics.jsonl 2>/dev/null
cp /tmp/default/metrics.jsonl $OUT/default_metrics.jsonl 2>/dev/null
for f in core core_compiled_layers default; do echo "--- $f"; grep -E "step [0-9]+/|done:|checkpoint|acceptance|Error" $OUT/$f.log | tail -5; done
