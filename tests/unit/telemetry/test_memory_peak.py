"""telemetry/memory_peak.py: a window's peak read and reset, the run's the largest window's, the closing line."""

import torch

from dflash_dist.telemetry import memory_peak
from dflash_dist.telemetry.memory_peak import GiB, PeakMemory
from dflash_dist.telemetry.metrics import run_summary


def test_on_cpu_nothing_is_read():
    m = PeakMemory(torch.device("cpu"))
    assert m.window() is None and m.run_peak is None and m.line(10 * GiB) is None


def test_each_window_reads_and_resets_the_peak_and_the_run_keeps_the_largest(monkeypatch):
    peaks = iter([3 * GiB, 7 * GiB, 5 * GiB])
    resets = []
    monkeypatch.setattr(memory_peak.torch.cuda, "max_memory_allocated", lambda device: next(peaks))
    monkeypatch.setattr(memory_peak.torch.cuda, "reset_peak_memory_stats", lambda device: resets.append(device))
    m = PeakMemory(torch.device("cuda", 0))
    assert [m.window(), m.window(), m.window()] == [3.0, 7.0, 5.0] and len(resets) == 3
    assert m.run_peak == 7 * GiB
    line = m.line(5 * GiB, "at its largest step (b=6, S_pad=640)")
    assert line == ("memory:     peak 7.00 GiB allocated over the run (torch.cuda.max_memory_allocated), planned "
                    "5.00 GiB at its largest step (b=6, S_pad=640) (+40%)")
    text = run_summary(stopped=False, steps=10, steps_this_run=10, samples=40, wall_s=2.0, loss=1.0, tau=None,
                       checkpoint=None, metrics_path="m.jsonl", wandb_dir=None, wandb_mode="disabled", memory=line)
    assert "\n  " + line + "\n" in text
