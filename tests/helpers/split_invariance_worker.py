"""Worker for tests/integration/test_split_invariance.py, run under torchrun (gloo) with 1 or 2 processes, each a
drafter rank of one DDP group. The same blocks train 5 steps: with one rank, each step's whole batch in 2
micro-batches (``drafter.tuning.micro_batches=2``); with two ranks, each rank one half of the batch's anchors
(one micro-batch). For each weighting (decay, dpace) the weights after the steps are written; ``dpace-per-rank``
is D-PACE with the step's weight sum left unreduced (each rank normalised by its own), the denominator the
invariance needs the all-reduce for."""

import argparse
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the helpers package
import helpers.standalone_drafter as S  # noqa: E402

from dflash_dist.comm.topology import Topology  # noqa: E402
from dflash_dist.drafter import trainer as trainer_mod  # noqa: E402
from dflash_dist.model.blocks import split_anchors  # noqa: E402

STEPS = 5


def train(args, rank: int, world: int, weighting: str, per_rank: bool) -> dict:
    micro = 2 if world == 1 else 1
    run_dir = os.path.join(args.out, f"run{world}_{rank}_{weighting}{'_pr' if per_rank else ''}")
    extra = [f"drafter.loss.weighting={weighting}", f"drafter.tuning.micro_batches={micro}", "train.warmup_ratio=0"]
    cfg = S.compose_job_config(S.job_overrides(True, None, None, 48, 64, 256, 4, STEPS, STEPS, run_dir, extra))
    job, ds = S.make_job(cfg, world + 1, torch.device("cpu"), run_dir)   # + 1 target (not started)
    job.dist.topo = Topology(world + 1, rank, 1)
    job.total_messages = STEPS                                           # the same lr schedule for either split
    trainer = S.make_trainer(job)
    if per_rank:  # the broken denominator: the weight sum's all-reduce skipped
        trainer_mod.dist = SimpleNamespace(all_reduce=lambda *a, **k: None)
    try:
        for s in range(STEPS):
            g = torch.Generator().manual_seed(1000 + s)
            feats = torch.randn(S.message_tokens(job, ds, s), trainer.feature_width, generator=g)
            batch = trainer.build(S.make_message(job, ds, s, torch.device("cpu"), feats.to(trainer.lm_head.dtype)), s)
            if world == 2:
                batch = split_anchors(batch, 2)[rank]
            trainer.cursor = s
            trainer.train_step(batch)
    finally:
        trainer_mod.dist = dist
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in ("decay", "dpace", "dpace-per-rank"):
        out[name] = train(args, rank, world, name.split("-")[0], name.endswith("per-rank"))
    torch.save(out, os.path.join(args.out, f"world{world}_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
