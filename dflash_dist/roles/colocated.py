"""A colocated rank (``topology.target_ranks=0``): the target and the drafter of one rank, in one thread.

The two role loops stay as they are and never see each other: the target half is a ``TargetRun`` whose Sender is
this rank's end of an in-process link (``comm/local.py``), the drafter half a ``DrafterRun`` whose receives come
from the other end. The drafter drives: each receive it completes runs the target half's next message (a capture
on the same device), so capture and training step alternate and the GPU never holds two roles' work at once, which
is all one GPU can give (two processes on one card would time-slice it; NCCL refuses two ranks of a communicator on
one device). After the last message the target half says END, as over the network.
"""

from __future__ import annotations

from dflash_dist.comm.local import LocalLink
from dflash_dist.roles.drafter_rank.loop import run_drafter
from dflash_dist.role_jobs import role_view
from dflash_dist.roles.target_rank.loop import TargetRun, load_target


def run_colocated(job) -> None:
    """Both halves of this rank's part of the job (``job``: the whole ``job.Job``)."""
    link = LocalLink(job.dist.rank, job.dist.device)
    target = role_view(job, "target", local=link)
    stream = TargetRun(target, load_target(target))  # hands its embedding and lm_head to the link
    messages = iter(stream.messages())

    def produce() -> None:
        j = next(messages, None)
        if j is None or not stream.step(j):  # the stream's end, or a graceful stop reached message j
            link.producer = None
            stream.finish()  # END on the link, then the last in-training evaluations
    link.producer = produce
    run_drafter(role_view(job, "drafter", local=link))
