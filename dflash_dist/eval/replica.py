"""What an in-training evaluation on a target replica of k ranks (``target.tensor_parallel`` > 1) needs: the
drafter's whole embedding and lm_head on the feeder, and the feeder's word to its followers (eval/in_training.py
runs the evaluation on both ends).

The model's own collectives need every rank of the replica in every forward, so each rank of replica 0 runs the
same verify steps. Only the feeder (the replica's first rank) receives the drafter weights and runs the drafter;
it broadcasts each block's proposals over the replica's gloo group, so every rank verifies the same tokens (the
target's greedy tokens then agree: the logits are gathered whole on every rank).

What the feeder decides, its followers hear at a point they reach too:
- during the stream, at each message boundary (after the replica's stop agreement, before the capture): whether
  an evaluation starts now (its weights are in), then, while one runs, before each verify step whether to run it
  (TargetEval._replica_slice: as long as the stream's own work took since the last boundary, at least one);
- after the stream, where the feeder may wait for the leader's last request longer than a collective should
  block: store keys ``dflash/replica_eval/<replica>/<i>`` (``run``: run the evaluation to its end; ``done``: no
  more), polled with the liveness check.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

log = logging.getLogger("dflash_dist")
KEY = "dflash/replica_eval/"
RUN, DONE = "run", "done"


def whole_head(job, model) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """(embedding, lm_head) [V, H] whole, for the drafter of an evaluation on this target: (None, None) on a
    single-rank target (speculative_steps takes the model's own); on a replica's rank, read by key from the
    checkpoint it was loaded from (the model's are shards)."""
    from dflash_dist.model.hf import load_head_from_checkpoint, random_target_dir, resolve_source
    topo = job.dist.topo
    if topo.tp == 1:
        return None, None
    path, _ = resolve_source(job.cfg.target)
    if path is None:  # random init: the checkpoint the replica was loaded from (model/hf.py build_target_replica)
        path = random_target_dir(job.run_dir, topo.node_of(topo.rank))
    tied = bool(getattr(job.hf_config, "tie_word_embeddings", False))
    embed, head = load_head_from_checkpoint(path, tied)
    like = next(model.parameters())
    dev, dtype = job.dist.device, like.dtype
    return embed.to(dev, dtype), head.to(dev, dtype)


class ReplicaLink:
    """The feeder's word to its replica's followers about evaluations (see the module docstring)."""

    def __init__(self, job):
        d = job.dist
        self.job, self.group, self.store = job, d.tp_ctrl, d.store
        self.src = d.topo.my_replica[0]
        self.is_feeder = d.rank == self.src
        self.prefix = f"{KEY}{d.topo.index}/"
        self.said = 0  # store keys posted (feeder) or read (follower)

    def boundary(self, run: bool = False) -> bool:
        """At a message boundary: the feeder's decision ``run`` reaches every rank of the replica."""
        flag = torch.tensor([int(run)])
        dist.broadcast(flag, self.src, group=self.group)
        return bool(flag.item())

    def post(self, what: str) -> None:
        """After the stream (feeder): an evaluation starts (RUN) or there will be no more (DONE)."""
        self.store.set(f"{self.prefix}{self.said}", what)
        self.said += 1

    def next_after_stream(self, limit: float) -> str:
        """After the stream (follower): the feeder's next word, waited for up to ``limit`` seconds with the
        liveness check (a dead rank ends the wait, named)."""
        from dflash_dist.comm.transport import poll_until
        key = f"{self.prefix}{self.said}"
        if not poll_until(lambda: self.store.check([key]), limit, self.job.life.check, max_sleep=5e-2):
            raise RuntimeError(f"timed out after {limit:.0f} s waiting for the replica's feeder to start or end "
                               "an evaluation")
        self.said += 1
        return self.store.get(key).decode()

    def broadcasting(self, draft_fn: Callable) -> Callable:
        """The feeder's draft function: the drafter's proposals, sent to every rank of the replica."""
        def draft(context: Tensor, block_ids: Tensor, p: int) -> Tensor:
            drafts = draft_fn(context, block_ids, p)
            dist.broadcast(drafts.reshape(-1).to("cpu", torch.long), self.src, group=self.group)
            return drafts
        return draft

    def receiving(self, block_size: int) -> Callable:
        """A follower's draft function: the feeder's proposals for this block."""
        def draft(context: Tensor, block_ids: Tensor, p: int) -> Tensor:
            drafts = torch.empty(block_size - 1, dtype=torch.long)
            dist.broadcast(drafts, self.src, group=self.group)
            return drafts.to(block_ids.device)
        return draft
