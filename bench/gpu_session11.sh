#!/usr/bin/env bash
# Device call 11 on 2x H200 (< 10 min):
#   1. bench/send_overlap.py with stream-level timing (calls 9 and 10 waited with torch.cuda.synchronize, which also waits
#      for the pending send itself): GEMM chain, then the real packed + compiled Qwen3-8B-shaped capture;
#   2. in parallel: GPU0 the reduced Qwen3-Next-shaped hybrid target without causal-conv1d (fla only), GPU1 the
#      same with causal-conv1d (goal 1b: the ratio), then bench/target_fresh_shapes.py (capture on unseen shapes).
# Usage: bash bench/gpu_session11.sh OUT_DIR     (carry .whl and .carry)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
for w in gemm capture; do
  echo "=== 1. send_overlap $w at $(el) s"
  timeout -k 10 ${SO_T:-100} torchrun --standalone --nproc-per-node 2 bench/send_overlap.py --workload $w --repeats 4 \
    --out $OUT/send_overlap_$w.json 2>&1 | grep -v "^W1" > $OUT/send_overlap_$w.log
  echo "exit ${PIPESTATUS[0]} at $(el) s"; grep -E "^\||workload:|Error" $OUT/send_overlap_$w.log
done
hybrid_kernels
HY=(--hybrid --tokens-per-pass 8192 --repeats 2 --warmup 1)
echo "=== 2. GPU0 hybrid without causal-conv1d | GPU1 hybrid with, then fresh shapes at $(el) s"
CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/fla:$PYTHONPATH timeout -k 10 ${HY_T:-200} python3 bench/target_capture.py "${HY[@]}" \
  --out $OUT/hybrid_without_cc1d.json > $OUT/hybrid_without_cc1d.log 2>&1 &
PA=$!
( export CUDA_VISIBLE_DEVICES=1
  PYTHONPATH=/tmp/cc1d:/tmp/fla:$PYTHONPATH timeout -k 10 80 python3 bench/target_capture.py "${HY[@]}" \
    --out $OUT/hybrid_with_cc1d.json > $OUT/hybrid_with_cc1d.log 2>&1
  echo "hybrid with cc1d exit $? at $(el) s"
  timeout -k 10 ${FS_T:-110} python3 bench/target_fresh_shapes.py --batches 16 --out $OUT/fresh_shapes.json > $OUT/fresh_shapes.log 2>&1
  echo "fresh shapes exit $? at $(el) s" )
wait $PA; echo "hybrid without cc1d exit $? at $(el) s"
grep -E "^\||fast path" $OUT/hybrid_with_cc1d.log | tail -5; grep -E "^\||fast path" $OUT/hybrid_without_cc1d.log | tail -5
grep -E "^\|" $OUT/fresh_shapes.log | tail -8
pack_results
