"""Worker for tests/integration/test_fsdp.py, run under torchrun (gloo) with W processes, each a drafter rank of
one data-parallel group (the real ``DrafterTrainer``, messages built in-process: helpers/standalone_drafter.py).
Every case trains the same messages from the same initial weights, message s*W + rank at step s, once under DDP
and once under FSDP2 (``drafter.parallel``); rank 0 writes, per case, each step's loss and gradient norm (the
logged window metrics, all-reduced over the ranks) and the whole weights and optimizer state at the end
(``DrafterParallel.full_state``: what a checkpoint holds)."""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the helpers package
import helpers.standalone_drafter as S  # noqa: E402
from helpers.worker_exit import finish  # noqa: E402

from dflash_dist.comm.topology import Topology  # noqa: E402

# case -> (steps, overrides); each FSDP case is compared with the DDP case of the same name
CASES = {
    "ddp": (20, ["drafter.parallel=ddp"]),
    "fsdp": (20, ["drafter.parallel=fsdp"]),
    "ddp-micro2": (4, ["drafter.parallel=ddp", "drafter.tuning.micro_batches=2"]),
    "fsdp-micro2": (4, ["drafter.parallel=fsdp", "drafter.tuning.micro_batches=2"]),
    "ddp-dflash2": (4, ["drafter.parallel=ddp", "drafter=tiny_dflash2"]),
    "fsdp-dflash2": (4, ["drafter.parallel=fsdp", "drafter=tiny_dflash2"]),
    "ddp-h8192": (4, ["drafter.parallel=ddp", "drafter=tiny_dflash_h8192", "target=tiny_h8192"]),
    "fsdp-h8192": (4, ["drafter=tiny_dflash_h8192", "target=tiny_h8192"]),  # the preset shards
    "fsdp-bf16": (5, ["drafter.parallel=fsdp", "drafter.tuning.grad_reduce_dtype=bfloat16"]),
}


def train(args, rank: int, world: int, name: str) -> dict:
    steps, extra = CASES[name]
    run_dir = os.path.join(args.out, f"run{world}_{rank}_{name}")
    drafter = next((x.split("=")[1] for x in extra if x.startswith("drafter=")), None)
    target = next((x.split("=")[1] for x in extra if x.startswith("target=")), None)
    extra = [x for x in extra if not x.startswith(("drafter=", "target="))] + ["train.warmup_ratio=0"]
    cfg = S.compose_job_config(S.job_overrides(True, target, drafter, 48, 256, 256, 4, steps, steps, run_dir, extra))
    job, ds = S.make_job(cfg, world + 1, torch.device("cpu"), run_dir)   # + 1 target (not started)
    job.dist.topo = Topology(world + 1, rank, 1)
    job.total_messages = 20 * world  # one lr schedule for every case: a shorter one trains its first steps
    trainer = S.make_trainer(job)
    out = {"losses": [], "grad_norms": [], "mode": trainer.parallel.mode}
    for s in range(steps):
        j = s * world + rank
        g = torch.Generator().manual_seed(1000 + j)
        feats = torch.randn(S.message_tokens(job, ds, j), trainer.feature_width, generator=g)
        msg = S.make_message(job, ds, j, torch.device("cpu"), feats.to(trainer.lm_head.dtype))
        trainer.cursor = s * world
        trainer.train_step(trainer.build(msg, j))
        window = trainer.read_window()
        out["losses"].append(window["loss"])
        out["grad_norms"].append(window["grad_norm"])
    out["weights"], out["optimizer"] = trainer.parallel.full_state(trainer.opt)
    out["fingerprint"] = trainer.parallel.fingerprint()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {name: train(args, rank, world, name) for name in CASES}
    if rank == 0:
        torch.save(out, os.path.join(args.out, f"world{world}.pt"))
    fps = [None] * world  # each rank's fingerprint of the FSDP run: its own shard
    dist.all_gather_object(fps, out["fsdp"]["fingerprint"])
    if rank == 0:
        torch.save(fps, os.path.join(args.out, f"world{world}_fingerprints.pt"))
    finish()  # helpers/worker_exit.py: no interpreter finalization racing gloo's threads


if __name__ == "__main__":
    main()
