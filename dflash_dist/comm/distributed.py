"""Process-group setup shared by every role.

Groups are created on every rank in the same order, members or not (torch requires it):
1. the default group: NCCL on GPU (eagerly initialised with ``device_id``), gloo on CPU;
2. ``ctrl``: a gloo group over all ranks for transport headers (host-side, never touches a CUDA stream);
   created before the split is known (data preparation waits on its barrier; ``target_ranks=auto``
   measures the split after that);
3. ``drafters``: the drafter data-parallel group (DDP, metric all-reduces), once the split is known;
4. ``evals``: the leader drafter and the first target, for the drafter weights of in-training evaluations. A group
   of their own: NCCL orders point-to-point operations per pair of ranks and group, so weights sent on the data
   group would queue in front of feature receives (a deadlock on GPU);
4b. ``tp`` (target.tensor_parallel > 1): one group per target replica (its ranks, in replica order; the device mesh of
   the replica's tensor-parallel plan) and ``tp_ctrl``, a gloo group per replica for the replica's own agreement
   (whether to run the next message); every rank creates all of them, members or not;
5. ``heads`` and ``head_replies`` (only with ``drafter.tuning.loss_on_target``): all ranks, the hidden rows from drafters
   to targets and the loss replies back (head_offload.py), apart from the features for the same reason, and apart
   from each other: a drafter posts a reply's receive only right before that group's backward, after its later
   groups' rows, so on one group the rows would queue behind a reply the target cannot send yet.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash_dist.comm.topology import Topology

log = logging.getLogger("dflash_dist")


@dataclass
class Dist:
    topo: Topology
    device: torch.device
    ctrl: object
    data: object
    drafters: object
    store: object
    evals: object = None
    tp: object = None       # this rank's replica group (target.tensor_parallel > 1; None otherwise / on drafters)
    tp_ctrl: object = None  # the same ranks over gloo: per-message agreement inside the replica
    heads: object = None
    head_replies: object = None

    @property
    def rank(self) -> int:
        return self.topo.rank


def init_distributed(device_type: str, timeout_s: float) -> tuple[int, int, torch.device]:
    """init_process_group from torchrun's environment; returns (rank, world, device)."""
    if "RANK" not in os.environ:
        raise RuntimeError("dflash_dist.train runs under torchrun: torchrun --standalone --nproc-per-node N "
                           "-m dflash_dist.train [overrides]")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    timeout = timedelta(seconds=timeout_s)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def make_ctrl_group(timeout_s: float):
    """Group 2 (see the module docstring): needs no split, so it exists before the data and the split do."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def make_groups(topo: Topology, device: torch.device, timeout_s: float, ctrl=None, heads: bool = False) -> Dist:
    """The groups of a split. ``ctrl``: the group from ``make_ctrl_group`` (made here first if None). ``heads``:
    also the group of ``drafter.tuning.loss_on_target`` (same value on every rank: it comes from the job's config)."""
    timeout = timedelta(seconds=timeout_s)
    if ctrl is None:
        ctrl = make_ctrl_group(timeout_s)
    drafters = dist.new_group(ranks=topo.drafter_ranks, timeout=timeout)
    tp_group = tp_ctrl = None
    if topo.tp > 1:
        for g, rep in enumerate(topo.replicas):
            grp = dist.new_group(ranks=rep, timeout=timeout)
            ctl = dist.new_group(ranks=rep, timeout=timeout, backend="gloo")
            if topo.role == "target" and topo.index == g:
                tp_group, tp_ctrl = grp, ctl
    # a colocated leader is its own first target: a group of one, unused (its evaluations cross comm/local.py)
    evals = dist.new_group(ranks=sorted({topo.drafter_ranks[0], topo.feeders[0]}), timeout=timeout)
    head_group = dist.new_group(timeout=timeout) if heads else None
    reply_group = dist.new_group(timeout=timeout) if heads else None
    store = dist.distributed_c10d._get_default_store()
    log.info("process groups ready (rank %d, %s)", topo.rank, topo.role)
    return Dist(topo=topo, device=device, ctrl=ctrl, data=dist.group.WORLD, drafters=drafters, store=store,
                evals=evals, tp=tp_group, tp_ctrl=tp_ctrl, heads=head_group, head_replies=reply_group)


def any_rank(flag: bool, group, device: torch.device = torch.device("cpu")) -> bool:
    """True on every rank of ``group`` when it is true on any (a MAX all-reduce; ``device``: where the group's
    backend takes tensors, the host for gloo). Ranks that must take the same branch into a collective agree so."""
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def shorten_timeouts(d: Dist, timeout_s: float) -> None:
    """After warm-up (model load, first compiles) a silent peer means a dead job: let the collectives give up
    after ``timeout_s`` instead of the long warm-up limit (torchtitan does the same)."""
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        return
    for g in [None, d.drafters] + [x for x in (d.tp, d.tp_ctrl) if x is not None]:
        try:
            set_timeout(timedelta(seconds=timeout_s), g)
        except Exception as e:  # non-member groups or backends without the hook
            log.debug("could not shorten timeout: %s", e)


class _BarAwareHandler(logging.StreamHandler):
    """Log lines that never land on a progress bar. In this process: written through ``tqdm.write`` (the bar is
    cleared, the line written, the bar redrawn). Other ranks' lines share the terminal with rank 0's bar (torchrun
    merges their output): on a terminal each line starts by erasing the partly drawn bar line (``\\r`` + erase line);
    rank 0 redraws its bar at its next update."""

    def __init__(self, stream, erase_line: bool):
        super().__init__(stream)
        self.prefix = "\r\x1b[2K" if erase_line else ""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm
            msg = self.prefix + self.format(record)
            if getattr(tqdm, "_instances", None):
                tqdm.write(msg, file=self.stream)
            else:
                self.stream.write(msg + self.terminator)
            self.flush()
        except Exception:
            self.handleError(record)


def setup_logging(rank: int, role: str) -> None:
    fmt = f"%(asctime)s [rank {rank} {role}] %(levelname)s %(message)s"
    stream = sys.stderr
    handler = _BarAwareHandler(stream, erase_line=rank != 0 and hasattr(stream, "isatty") and stream.isatty())
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    for noisy in ("httpx", "urllib3", "filelock", "torch._inductor", "torch._dynamo"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
