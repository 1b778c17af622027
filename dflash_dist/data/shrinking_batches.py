"""Batches that halve when the device runs out of memory (``dflash-regenerate``'s generate calls).

A chunk of rows whose call raises ``torch.OutOfMemoryError`` is retried as two halves (recursively, down to one
row), after the allocator's cache is freed; the smaller size is kept for every later chunk, so a process that ran
out once does not run out again on each batch. One row that does not fit alone is a ``RowTooLarge`` error."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Sequence

import torch

log = logging.getLogger("dflash_dist")

_OOM = object()


class RowTooLarge(RuntimeError):
    """One row alone does not fit the device memory."""


def device_memory(device) -> str:
    """``cuda:0, 79.1 GiB total, 0.4 GiB free`` (or the device's name where it reports no memory)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(device)
        return f"{device}, {total / 2**30:.1f} GiB total, {free / 2**30:.1f} GiB free"
    return str(device)


class ShrinkingBatches:
    """Consecutive chunks of ``size`` rows; ``size`` halves on ``torch.OutOfMemoryError`` and stays halved.

    ``label`` starts the log lines (``rank 3``), ``knob`` is the setting they name (``--batch-size``)."""

    def __init__(self, size: int, *, device, label: str = "", knob: str = "--batch-size"):
        self.size = size
        self.device = torch.device(device)
        self.label = label
        self.knob = knob
        self.halvings = 0

    def run(self, items: Sequence, call: Callable[[Sequence], Any],
            describe: Callable[[Any], str]) -> Iterator[tuple[Sequence, Any]]:
        """Yield ``(chunk, call(chunk))`` over ``items`` in order. ``describe(row)`` names a row that does not fit
        alone (the ``RowTooLarge`` message)."""
        pos = 0
        while pos < len(items):
            chunk = items[pos:pos + self.size]
            result = self._attempt(call, chunk)
            if result is _OOM:  # handled here, outside the except block: its traceback held the failed call's tensors
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                if len(chunk) == 1:
                    raise RowTooLarge(f"{describe(chunk[0])} does not fit the device memory alone "
                                      f"({device_memory(self.device)})")
                self._halve(len(chunk))
                continue
            yield chunk, result
            pos += len(chunk)

    @staticmethod
    def _attempt(call, chunk):
        try:
            return call(chunk)
        except torch.OutOfMemoryError:
            return _OOM

    def _halve(self, n: int) -> None:
        self.size = (n + 1) // 2
        self.halvings += 1
        split = f"2 x {self.size}" if n % 2 == 0 else f"{self.size} + {n - self.size}"
        log.warning("%sbatch of %d rows ran out of device memory; retrying as %s (set %s %d to avoid the retries)",
                    f"{self.label}: " if self.label else "", n, split, self.knob, self.size)
