#!/usr/bin/env bash
# Launch a dflash_dist training job on ONE machine.
#
#   launch/single_node.sh NPROC [hydra overrides...]
#
# Runs `dflash-train --nproc-per-node NPROC [overrides]` (torch's elastic launcher, a standalone rendezvous). The last
# topology.target_ranks ranks run the frozen target, the rest train the drafter; NPROC is usually the number of
# GPUs (8 on an 8-GPU node), on CPU any small number >= 2 works (gloo).
#
# Examples:
#   launch/single_node.sh 2                                          # default tiny CPU job
#   launch/single_node.sh 8 target=qwen3_8b_random topology.target_ranks=2 train.output_dir=/ckpt/run1
#
# Environment (each only set when you have not set it yourself):
#   OMP_NUM_THREADS                   CPU cores / NPROC (at least 1): stops NPROC processes oversubscribing cores
#   NCCL_NVLS_ENABLE=0                NVLink SHARP (multicast) off: not available on every host/container
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1 a rank that fails takes the NCCL communicator (and the job) down, no hang
#   PYTORCH_CUDA_ALLOC_CONF           expandable_segments:True on GPU hosts (less fragmentation with ragged
#                                     batches); left unset on CPU-only hosts
#   PYTHON                            interpreter to use (default: python3)
set -euo pipefail

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[[ $# -ge 1 ]] || usage
NPROC=$1; shift
[[ $NPROC =~ ^[1-9][0-9]*$ ]] || { echo "single_node.sh: NPROC must be a positive integer, got '$NPROC'" >&2; usage; }

# shellcheck source=launch/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

# `python -m dflash_dist.cli.train` is dflash-train, bound to the same interpreter as the installed project: wrong
# settings exit 2; Ctrl-C / SIGTERM checkpoint, print the command that continues the run and exit 130 / 143.
# Relative paths in overrides (train.output_dir=outputs/x, data.source=...) are relative to the current directory.
exec "${PYTHON:-python3}" -m dflash_dist.cli.train --nproc-per-node "$NPROC" "$@"
