"""Worker for tests/integration/test_split_invariance.py, run under torchrun (gloo) with 1 or 2 processes, each a
drafter rank of one DDP group. The same blocks train 5 steps: with one rank, each step's whole batch in 2
micro-batches (``drafter.tuning.micro_batches=2``); with two ranks, each rank one half of the batch's anchors
(one micro-batch). For each objective of ``CASES`` (decay, dpace; the target's labels with each, labels=target
with the target's greedy tokens given in the message, and kind=kl with its top-k) the weights after the steps are
written; ``*-per-rank`` is the objective with the step's weight sum left unreduced (each rank normalised by its
own), the denominator the invariance needs the all-reduce for."""

import argparse
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the helpers package
import helpers.standalone_drafter as S  # noqa: E402
from helpers.worker_exit import finish  # noqa: E402

from dflash_dist.comm.topology import Topology  # noqa: E402
from dflash_dist.roles.drafter_rank import trainer as trainer_mod  # noqa: E402
from dflash_dist.model.blocks import split_anchors  # noqa: E402

STEPS = 5
TARGET_LABELS = ["drafter.loss.labels=target"]
KL = TARGET_LABELS + ["drafter.loss.kind=kl", "drafter.loss.kl_top_k=4"]
CASES = {"decay": ["drafter.loss.weighting=decay"], "dpace": ["drafter.loss.weighting=dpace"],
         "target": TARGET_LABELS, "target-dpace": TARGET_LABELS + ["drafter.loss.weighting=dpace"], "kl": KL}
PER_RANK = ("dpace", "target", "kl")  # also trained with the broken denominator


def with_target_labels(msg, loss, vocab: int, step: int):
    """The message as a target sends it under labels=target: its top-k next tokens per position (k = 1 for ce),
    and their renormalised probabilities for kind=kl, drawn from the step's seed (the same for either split)."""
    if loss.labels != "target":
        return msg
    k = loss.kl_top_k if loss.kind == "kl" else 1
    g = torch.Generator().manual_seed(2000 + step)
    logits = torch.randn(msg.input_ids.numel(), vocab, generator=g)
    top = logits.topk(k, dim=-1)
    msg.target_ids = top.indices
    msg.target_probs = torch.softmax(top.values, -1) if loss.kind == "kl" else None
    msg.validate()
    return msg


def train(args, rank: int, world: int, name: str, per_rank: bool) -> dict:
    micro = 2 if world == 1 else 1
    run_dir = os.path.join(args.out, f"run{world}_{rank}_{name}{'_pr' if per_rank else ''}")
    extra = CASES[name] + [f"drafter.tuning.micro_batches={micro}", "train.warmup_ratio=0"]
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
            msg = S.make_message(job, ds, s, torch.device("cpu"), feats.to(trainer.lm_head.dtype))
            msg = with_target_labels(msg, trainer.spec.loss, trainer.lm_head.shape[0], s)
            batch = trainer.build(msg, s)
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
    for name in CASES:
        out[name] = train(args, rank, world, name, False)
    for name in PER_RANK:
        out[f"{name}-per-rank"] = train(args, rank, world, name, True)
    torch.save(out, os.path.join(args.out, f"world{world}_rank{rank}.pt"))
    finish()  # helpers/worker_exit.py: no interpreter finalization racing gloo's threads


if __name__ == "__main__":
    main()
