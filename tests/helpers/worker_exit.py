"""The end of a torchrun test worker (gloo): leave without Python's finalization.

A gloo collective's work object can be freed by gloo's own worker thread a moment after the caller's wait returns
(a barrier keeps the collectives still in flight when it was queued: all_gather_object's tensors among them).
Freeing those tensors takes the GIL; if the main thread has begun finalizing the interpreter by then, the worker
thread exits inside C++ and the process aborts with "terminate called without an active exception" (SIGABRT),
after every result was written. destroy_process_group does not join those threads while a DDP or FSDP module not
yet collected still holds the group. The workers' files are closed by then: exit at once."""

import os
import sys

import torch.distributed as dist


def finish() -> None:
    """Barrier (every rank has written its files), destroy the process group, flush, os._exit(0)."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
