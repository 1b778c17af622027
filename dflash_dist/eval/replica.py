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
import os
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from dflash_dist.config import ConfigError

log = logging.getLogger("dflash_dist")
KEY = "dflash/replica_eval/"
RUN, DONE = "run", "done"


def whole_head(job, model) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """(embedding, lm_head) [V, H] whole, for the drafter of an evaluation on this target: (None, None) on a
    single-rank target (speculative_steps takes the model's own); on a replica's rank, read by key from the
    checkpoint it was loaded from (the model's are shards)."""
    from dflash_dist.targets.hf import load_head_from_checkpoint, random_target_dir, resolve_source
    topo = job.dist.topo
    if topo.tp == 1:
        return None, None
    path, _ = resolve_source(job.cfg.target)
    if path is None:  # random init: the checkpoint the replica was loaded from (targets/hf.py build_target_replica)
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
        return broadcasting(draft_fn, self.src, self.group)

    def receiving(self, block_size: int) -> Callable:
        return receiving(block_size, self.src, self.group)


def broadcasting(draft_fn: Callable, src: int, group) -> Callable:
    """The feeder's draft function: the drafter's proposals, sent to every rank of the replica (``group``, gloo)."""
    def draft(context: Tensor, block_ids: Tensor, p: int) -> Tensor:
        drafts = draft_fn(context, block_ids, p)
        dist.broadcast(drafts.reshape(-1).to("cpu", torch.long), src, group=group)
        return drafts
    return draft


def receiving(block_size: int, src: int, group) -> Callable:
    """A follower's draft function: the feeder's proposals for this block."""
    def draft(context: Tensor, block_ids: Tensor, p: int) -> Tensor:
        drafts = torch.empty(block_size - 1, dtype=torch.long)
        dist.broadcast(drafts, src, group=group)
        return drafts.to(block_ids.device)
    return draft


# ---- dflash-eval on a replica: ``torchrun --nproc-per-node K -m dflash_dist.cli.eval ...`` (one node, K ranks)

class EvalReplica:
    """The K processes of a ``dflash-eval`` under torchrun: every rank holds a shard of the target (transformers'
    tensor-parallel plan over all K) and runs the same verify forwards; rank 0 alone runs the drafter, with the
    target's embedding and lm_head read whole from the checkpoint, and broadcasts each block's proposals; rank 0
    alone prints and writes the result."""

    def __init__(self, device: str):
        import datetime
        world, local = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        if local != world:
            raise ConfigError(f"dflash-eval on a target replica runs on one node ({world} ranks, {local} on this "
                              "node): a replica's ranks share a node")
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(minutes=30))
        self.rank, self.k, self.device = dist.get_rank(), world, device
        self.group = dist.group.WORLD
        # the proposals and the random target's path travel over gloo (host tensors), whatever the device
        self.ctrl = dist.new_group(backend="gloo") if device == "cuda" else self.group
        self.is_feeder = self.rank == 0
        self._tmp: Optional[str] = None

    def build_target(self, tcfg, where: Optional[str]):
        """This rank's shard of the target at ``where`` (a local directory), or of the random-init target of
        ``tcfg`` (``where`` None), which rank 0 builds whole and seeded as one process would and writes to a
        temporary directory first (removed by ``close``). Returns (model, the checkpoint directory)."""
        import tempfile

        from dflash_dist.targets.hf import build_target_replica, resolve_source
        tcfg.name_or_path = where
        path, _ = resolve_source(tcfg)
        if path is None:
            box = [tempfile.mkdtemp(prefix="dflash-eval-target-") if self.is_feeder else None]
            dist.broadcast_object_list(box, src=0, group=self.ctrl)
            self._tmp = box[0]
            barrier = (lambda: dist.barrier(group=self.ctrl))
            model = build_target_replica(tcfg, self.device, self.group, random_dir=self._tmp,
                                         build_random=self.is_feeder, ready=(barrier, barrier))
            return model, self._tmp
        model = build_target_replica(tcfg, self.device, self.group)
        if not os.path.isdir(path):  # a hub id: the snapshot the load just used, for the head's tensors
            from huggingface_hub import snapshot_download
            path = snapshot_download(path, local_files_only=True)
        return model, path

    def draft_fn(self, make: Callable, checkpoint_dir: str, tied: bool, dtype: torch.dtype, block_size: int):
        """Rank 0: ``make(embed, lm_head)`` (the drafter's draft function over the whole head), broadcasting;
        the other ranks: the receiving end. Returns (draft function, embed, lm_head) (None, None on followers)."""
        if not self.is_feeder:
            return receiving(block_size, 0, self.ctrl), None, None
        from dflash_dist.targets.hf import load_head_from_checkpoint
        embed, head = load_head_from_checkpoint(checkpoint_dir, tied)
        dev = torch.device(self.device, torch.cuda.current_device()) if self.device == "cuda" else torch.device("cpu")
        embed, head = embed.to(dev, dtype), head.to(dev, dtype)
        return broadcasting(make(embed, head), 0, self.ctrl), embed, head

    def close(self, ok: bool = True) -> None:
        """After the result (``ok``): wait for every rank, remove the random target's directory, leave the group.
        After an error: only remove the directory (a barrier would wait on ranks still in a collective)."""
        import shutil
        if ok:
            dist.barrier(group=self.ctrl)
        if self.is_feeder and self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
        if ok:
            dist.destroy_process_group()
