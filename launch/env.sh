#!/usr/bin/env bash
# Sourced by the launchers (needs NPROC set): per-rank threads and the GPU defaults, each only if unset.
cores=$(nproc 2>/dev/null || echo 1)
threads=$(( cores / NPROC )); (( threads >= 1 )) || threads=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}   # NVLink multicast off: it can take shared GPUs down
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  if [[ -z ${PYTORCH_CUDA_ALLOC_CONF:-} && -z ${PYTORCH_ALLOC_CONF:-} ]]; then
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  fi
fi
export PYTHONUNBUFFERED=1
