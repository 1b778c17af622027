#!/usr/bin/env bash
# Fourth (short) device call on 2x H200: the real job at HEAD, three runs at once on the two GPUs (proof runs,
# not timings): the 0.6B-shaped core job with the defaults, the same with drafter.compile_layers=true, and the
# embedded default job (tiny target, builtin data, in-training evaluation). Usage: bash bench/gpu_session4.sh OUT
set -uo pipefail
OUT=${1:-/tmp/gpu_session4}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1 WANDB_MODE=disabled
export TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=false TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
common="logging.wandb.mode=disabled logging.progress_bar=false"
core="target=qwen3_0p6b_random drafter=dflash data.source=synthetic:550:3000 target.max_batch_tokens=4096 train.max_steps=60 logging.log_every=10"
T=${T:-150}
timeout -k 5 $T torchrun --standalone --nproc-per-node 2 -m dflash_dist.train $core train.output_dir=/tmp/core $common 2>&1 | grep -v "^W1" > $OUT/core.log &
P1=$!
timeout -k 5 $T torchrun --standalone --nproc-per-node 2 -m dflash_dist.train $core drafter.compile_layers=true train.output_dir=/tmp/core_cl $common 2>&1 | grep -v "^W1" > $OUT/core_compiled_layers.log &
P2=$!
timeout -k 5 $T torchrun --standalone --nproc-per-node 2 -m dflash_dist.train train.output_dir=/tmp/default $common logging.log_every=20 2>&1 | grep -v "^W1" > $OUT/default.log &
P3=$!
wait $P1; echo "core exit $? at $(el) s"; wait $P2; echo "core compile_layers exit $? at $(el) s"; wait $P3; echo "default exit $? at $(el) s"
cp /tmp/core/startup_report.json $OUT/ 2>/dev/null; cp /tmp/core/metrics.jsonl $OUT/core_metrics.jsonl 2>/dev/null
cp /tmp/default/metrics.jsonl $OUT/default_metrics.jsonl 2>/dev/null
for f in core core_compiled_layers default; do echo "--- $f"; grep -E "step [0-9]+/|done:|checkpoint|acceptance|Error" $OUT/$f.log | tail -5; done
