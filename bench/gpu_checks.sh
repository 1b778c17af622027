#!/usr/bin/env bash
# GPU checks for issues [1/6] and [2/6], one device call on a 2-GPU H200 machine, every part time-boxed.
#   bash bench/gpu_checks.sh OUT_DIR
# A: dflash-doctor table (fla + causal-conv1d on the path)
# B: hybrid Qwen3-Next-shaped target without causal-conv1d: refused under fast_path=require, runs under warn;
#    and with both kernels present under require
# C: 1 target + 1 drafter over NCCL, Qwen3-0.6B-shaped target, compiled flex drafter: startup report + samples/s
set -uo pipefail
OUT=${1:-/tmp/gpu_checks}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1 TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=false
BASE_PP=${PYTHONPATH:-}
FLA=/tmp/fla_site; CC1D=/tmp/cc1d
python3 -m pip install -q --no-index --no-deps --no-compile --target $FLA .carry/fla/*.whl >/dev/null 2>&1
mkdir -p $CC1D && tar xJf .carry/causal_conv1d-*.tar.xz -C $CC1D
CC1D_DIR=$(dirname "$(find $CC1D -name '__init__.py' -path '*causal_conv1d/*' | head -1)")/..
echo "causal-conv1d dir: $CC1D_DIR"
common="train.output_dir=/tmp/run logging.wandb.mode=disabled logging.progress_bar=false"
PARTS=${PARTS:-A B B3 C}   # which parts to run
has() { [[ " $PARTS " == *" $1 "* ]]; }

has A && { echo "=== A: doctor"; PYTHONPATH=$FLA:$CC1D_DIR:$BASE_PP timeout ${DOCTOR_T:-90} python3 -m dflash_dist.cli.doctor --json $OUT/doctor.json 2>&1 | tail -30
echo "doctor exit: ${PIPESTATUS[0]}"; }
hyb="target=qwen3_next_small drafter=tiny drafter.attention_backend=sdpa data.source=synthetic:550:64 train.max_steps=3 logging.log_every=1"
if has B; then
echo "=== B1: hybrid, fla only, fast_path=require (expect refusal)"
rm -rf /tmp/run; PYTHONPATH=$FLA:$BASE_PP timeout ${B1_T:-80} torchrun --standalone --nproc-per-node 2 -m dflash_dist.train $hyb $common target.fast_path=require 2>&1 | grep -v "^W1" | grep -iE "fast|causal|error|refus|exit" | head -12
echo "B1 exit: ${PIPESTATUS[0]}"
echo "=== B2: hybrid, fla only, fast_path=warn (expect a warning, then training)"
rm -rf /tmp/run; PYTHONPATH=$FLA:$BASE_PP timeout ${B2_T:-120} torchrun --standalone --nproc-per-node 2 -m dflash_dist.train $hyb $common target.fast_path=warn 2>&1 | grep -v "^W1" | grep -iE "fast|causal|warn|step|done|error" | head -14
echo "B2 exit: ${PIPESTATUS[0]}"
fi
if has B3; then
echo "=== B3: hybrid, fla + causal-conv1d, fast_path=require"
rm -rf /tmp/run; PYTHONPATH=$FLA:$CC1D_DIR:$BASE_PP timeout 120 torchrun --standalone --nproc-per-node 2 -m dflash_dist.train $hyb $common target.fast_path=require 2>&1 | grep -v "^W1" | grep -iE "fast|causal|step|done|error" | head -12
echo "B3 exit: ${PIPESTATUS[0]}"
fi
has C || exit 0

echo "=== C: core 1+1, Qwen3-0.6B-shaped target, 5-layer flex drafter, 512 anchors, ~550-token samples"
rm -rf /tmp/run; timeout ${CORE_TIMEOUT:-200} torchrun --standalone --nproc-per-node 2 -m dflash_dist.train target=qwen3_0p6b_random drafter=dflash \
  data.source=synthetic:550:2000 target.max_batch_samples=1 drafter.tuning.ctx_bucket=1024 train.max_steps=${CORE_STEPS:-150} \
  logging.log_every=25 $common 2>&1 | grep -v "^W1" | tee $OUT/core.log | tail -45
echo "C exit: ${PIPESTATUS[0]}"
cp /tmp/run/startup_report.json $OUT/ 2>/dev/null; cp /tmp/run/metrics.jsonl $OUT/core_metrics.jsonl 2>/dev/null
