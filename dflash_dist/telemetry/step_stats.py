"""Named slots of the per-step statistics, accumulated on the device and all-reduced as one tensor.

The trainer, its objective and its variant each declare their slots (name -> size); values are added by name
(device tensors, no host sync); a logging window reads them with one all-reduce and one copy to the host. No
call site indexes the tensor.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["StepStats"]


class StepStats:
    """One float64 tensor cut into named slots (``slots``: name -> size, in order)."""

    def __init__(self, slots: dict[str, int], device):
        self.slots: dict[str, slice] = {}
        at = 0
        for name, size in slots.items():
            if name in self.slots:
                raise ValueError(f"statistic {name!r} declared twice")
            if int(size) < 1:
                raise ValueError(f"statistic {name!r}: size {size} must be >= 1")
            self.slots[name] = slice(at, at + int(size))
            at += int(size)
        self.buf = torch.zeros(at, dtype=torch.float64, device=device)

    def add(self, name: str, value) -> None:
        """Add ``value`` (a tensor of the slot's size or a scalar) to the slot ``name``."""
        sl = self.slots[name]
        if isinstance(value, torch.Tensor):
            value = value.detach().double().reshape(-1) if value.numel() > 1 else value.detach().double().reshape(())
        self.buf[sl] += value

    def add_all(self, values: dict) -> None:
        for name, value in values.items():
            self.add(name, value)

    def peek(self, name: str) -> torch.Tensor:
        """The slot's local sums since the last read (not reduced, not reset)."""
        return self.buf[self.slots[name]]

    def read(self, group: Optional[object] = None, reduce: bool = True) -> dict[str, list[float]]:
        """The sums since the last read, summed over ``group`` (an all-reduce when a process group is up), as
        {name: list of floats}; the slots start again from zero."""
        acc = self.buf.clone()
        if reduce and dist.is_available() and dist.is_initialized():
            dist.all_reduce(acc, group=group)
        self.buf.zero_()
        v = acc.tolist()
        return {name: v[sl] for name, sl in self.slots.items()}
