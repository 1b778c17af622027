"""A GPU rank's peak memory over each logging window and over the run, to hold next to its memory plan.

The startup report compares the plan with one profiled step; the steps after it (other batch shapes, an
in-training evaluation on a colocated rank) can need more. Each window reads and resets
``torch.cuda.max_memory_allocated``; the run's peak is the largest window's. On CPU nothing is read (a process's
resident peak is not a per-window figure)."""

from __future__ import annotations

from typing import Optional

import torch

GiB = 1 << 30


class PeakMemory:
    def __init__(self, device: torch.device):
        self.device = device
        self.run_peak: Optional[int] = None

    def window(self) -> Optional[float]:
        """GiB allocated at the peak since the last call (None off CUDA); the peak counter starts again."""
        if self.device.type != "cuda":
            return None
        peak = int(torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        self.run_peak = peak if self.run_peak is None else max(self.run_peak, peak)
        return peak / GiB

    def line(self, planned_bytes: Optional[int], where: str = "") -> Optional[str]:
        """The run's peak next to the plan of its largest planned step (``planned_bytes``: the plan without the
        process's own base, which the allocator does not count), or None before any window."""
        if self.run_peak is None:
            return None
        text = f"memory:     peak {self.run_peak / GiB:.2f} GiB allocated over the run (torch.cuda.max_memory_allocated)"
        if planned_bytes:
            text += (f", planned {planned_bytes / GiB:.2f} GiB{' ' + where if where else ''}"
                     f" ({(self.run_peak - planned_bytes) / planned_bytes:+.0%})")
        return text
