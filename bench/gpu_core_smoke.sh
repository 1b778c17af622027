#!/usr/bin/env bash
# Issue [1/6] GPU check: 1 target + 1 drafter over NCCL on 2 GPUs, Qwen3-0.6B-shaped random-init target,
# 5-layer drafter, synthetic ~550-token samples. Usage (on a 2-GPU machine, from the repo root):
#   bash bench/gpu_core_smoke.sh OUT_DIR [extra overrides]
set -uo pipefail
OUT=${1:-/tmp/gpu_core}; shift || true
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'transformers', transformers.__version__)"
RUN=/tmp/dflash_core_run
rm -rf "$RUN"
torchrun --standalone --nproc-per-node 2 -m dflash_dist.train target=qwen3_0p6b_random drafter=dflash \
  data.source=synthetic:550:3000 target.max_batch_tokens=4096 train.max_steps=60 logging.log_every=10 \
  train.output_dir=$RUN logging.wandb.mode=disabled logging.progress_bar=false "$@" 2>&1 | tee "$OUT/core_run.log"
rc=${PIPESTATUS[0]}
cp "$RUN/metrics.jsonl" "$OUT/core_metrics.jsonl" 2>/dev/null
echo "exit code: $rc"
exit $rc
