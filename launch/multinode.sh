#!/usr/bin/env bash
# Launch one node's share of a multi-node dflash_dist job by hand (no SLURM). Run it once on EVERY node:
#
#   launch/multinode.sh NNODES NODE_RANK HEAD_ADDR NPROC [hydra overrides...]
#
#   NNODES     number of nodes in the job
#   NODE_RANK  0..NNODES-1; node 0 hosts the c10d rendezvous store (on HEAD_ADDR:RDZV_PORT)
#   HEAD_ADDR  address of node 0 that every node can reach
#   NPROC      processes (GPUs) on this node
#
# Example, two 8-GPU nodes, node-a = 10.0.0.1:
#   node-a$ launch/multinode.sh 2 0 10.0.0.1 8 topology.target_ranks=4 train.output_dir=/shared/runs/r1
#   node-b$ launch/multinode.sh 2 1 10.0.0.1 8 topology.target_ranks=4 train.output_dir=/shared/runs/r1
#
# Every node must get the SAME overrides, and train.output_dir must be on storage all nodes share (rank 0 writes
# the tokenized data cache there and every rank reads it; checkpoints and metrics live there too).
# Global ranks are assigned node by node, so the target ranks (the last topology.target_ranks) sit on the last
# node(s). The c10d rendezvous orders nodes by host name, not by NODE_RANK: NODE_RANK only picks the store host.
#
# Environment (each only set when you have not set it yourself):
#   RDZV_PORT=29500, RDZV_ID=dflash   rendezvous port on HEAD_ADDR and job id (use a new RDZV_ID per job when
#                                     several jobs share a head node)
#   OMP_NUM_THREADS, NCCL_NVLS_ENABLE=0, TORCH_NCCL_ASYNC_ERROR_HANDLING=1, PYTORCH_CUDA_ALLOC_CONF on GPU:
#                                     as in launch/single_node.sh
#   PYTHON                            interpreter to use (default: python3)
# On hosts with several network interfaces, point NCCL and gloo at the one the nodes share, e.g.
#   NCCL_SOCKET_IFNAME=eth0 GLOO_SOCKET_IFNAME=eth0 launch/multinode.sh ...
# (the transport's control channel is a gloo group over all ranks, so gloo must be able to cross nodes).
set -euo pipefail

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[[ $# -ge 4 ]] || usage
NNODES=$1 NODE_RANK=$2 HEAD_ADDR=$3 NPROC=$4; shift 4
for v in NNODES NPROC; do
  [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "multinode.sh: $v must be a positive integer, got '${!v}'" >&2; usage; }
done
if ! [[ $NODE_RANK =~ ^[0-9]+$ ]] || (( NODE_RANK >= NNODES )); then
  echo "multinode.sh: NODE_RANK must be in 0..$((NNODES - 1)), got '$NODE_RANK'" >&2; usage
fi

# shellcheck source=launch/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

# is_host: node 0 hosts the rendezvous store explicitly (torchrun's guess compares HEAD_ADDR with this host's
# names and addresses, which fails e.g. behind NAT or with a load-balancer address)
is_host=0; (( NODE_RANK == 0 )) && is_host=1
exec "${PYTHON:-python3}" -m torch.distributed.run \
  --nnodes "$NNODES" --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$HEAD_ADDR:${RDZV_PORT:-29500}" --rdzv-id "${RDZV_ID:-dflash}" \
  --rdzv-conf "is_host=$is_host" \
  -m dflash_dist.train "$@"
