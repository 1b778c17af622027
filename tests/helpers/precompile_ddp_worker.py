"""Worker for tests/unit/roles/drafter_rank/test_drafter_loop.py, run under torchrun (gloo): two drafter ranks in one DDP group run a
different number of dry steps (``DrafterTrainer.precompile``), then one real training step each. The dry steps
must make no collective: were one to all-reduce, the ranks' collectives would pair up wrongly and the job would
hang or fail. Each rank writes its weights' checksum after the real step (DDP keeps them equal)."""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the helpers package
import helpers.standalone_drafter as S  # noqa: E402
from helpers.worker_exit import finish  # noqa: E402

from dflash_dist.comm.topology import Topology  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cpu = torch.device("cpu")
    run_dir = os.path.join(args.out, f"run{rank}")
    cfg = S.compose_job_config(S.job_overrides(True, None, None, 48, 64, 256, 4, 4, 2, run_dir, []))
    job, ds = S.make_job(cfg, 3, cpu, run_dir)      # 2 drafters (these two processes) + 1 target (not started)
    job.dist.topo = Topology(3, rank, 1)
    trainer = S.make_trainer(job)
    steps = trainer.planned_steps
    trainer.precompile_plan = [steps[0], [300]] if rank == 0 else [steps[0]]  # a different count per rank
    took = trainer.precompile()
    j = S.my_messages(job)[0]
    g = torch.Generator().manual_seed(rank)
    feats = torch.randn(S.message_tokens(job, ds, j), trainer.feature_width, generator=g)
    trainer.train_step(trainer.build(S.make_message(job, ds, j, cpu, feats), job.start_cursor + j))
    checksum = float(sum(p.detach().double().sum() for p in trainer.model.parameters()))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "dry_steps": len(trainer.precompile_plan), "seconds": took,
                   "checksum": checksum, "grads_left": any(p.grad is not None for p in trainer.model.parameters())},
                  f)
    finish()  # helpers/worker_exit.py: no interpreter finalization racing gloo's threads


if __name__ == "__main__":
    main()
