"""One training step under torch.profiler, written as a Chrome trace, and its phase timeline.

The drafter's step marks its phases (``phase``): each anchor group's forward, its loss here or its head request
to a target, each group's backward (after its reply, if a target computes its loss), the optimizer. ``timeline``
reads a trace back and says, per phase, when it started on the GPU (offsets from the step's first kernel), how
long it ran (to the next phase's start), how long its kernels were busy and how long the GPU sat idle: where a
step's time goes, e.g. whether splitting the anchors into groups costs more than the loss the targets take over.
On CPU (no GPU timeline) the phases' host starts are used.

    logging.debug.profile_step=N   a training job's drafter ranks trace step N, its targets their message for step N
                             -> <output_dir>/profile/
    dflash-report RUN_DIR          the table of every written trace of the run, and phases.png
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch

PREFIX = "dflash/"


def phase(name: str):
    """A named phase of the step in a profile (a no-op costing microseconds when no profiler runs)."""
    return torch.profiler.record_function(PREFIX + name)


class TraceWindow:
    """torch.profiler over a stretch of work (CPU and, on CUDA, GPU activity), started and stopped by hand.
    A window that starts or stops while a gloo isend is in flight can crash the sender
    (bench/experiments/profiler_gloo_window.py): a target drains its sends first (target.loop.MessageTrace)."""

    def __init__(self, device):
        from torch.profiler import ProfilerActivity, profile
        cuda = torch.device(device).type == "cuda"
        self.prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))

    def start(self) -> None:
        self.prof.start()

    def stop(self, path: str) -> dict:
        """Stop, write the Chrome trace to ``path``, return its ``timeline``."""
        self.prof.stop()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.prof.export_chrome_trace(path)
        return timeline(load_trace(path))


def traced_step(step_fn: Callable[[], None], path: str, device):
    """Run ``step_fn()`` under torch.profiler, write the Chrome trace to ``path``; returns (its ``timeline``, the
    profiler). Synchronizes the device before and after: the step runs alone."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    window = TraceWindow(device)
    if cuda:
        torch.cuda.synchronize(device)
    window.start()
    step_fn()
    if cuda:
        torch.cuda.synchronize(device)
    return window.stop(path), window.prof


def load_trace(path: str) -> dict | list:
    """A Chrome trace from ``path`` (.json, or .json.gz as stored under docs/results)."""
    import gzip
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


def _merged_busy(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of (start, end) spans."""
    busy, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    return busy


def timeline(trace: dict | list) -> dict:
    """Phases of a traced step (events named ``dflash/...``), in start order, in ms from the step's start.

    A phase runs from its start to the next phase's start (the last one to the step's end): on the GPU clock the
    annotations' own spans leave out kernels launched by compiled code and by the autograd engine's thread, their
    starts do not. Returns {"clock": "gpu" | "host", "step_ms", "busy_ms" (kernels' union), "phases": [{"name",
    "start_ms", "ms", "busy_ms", "idle_ms"}], "waits": NCCL kernels by total ms}. "gpu": starts of the GPU
    annotations, busy the union of all kernels inside each phase, idle the rest; "host": the CPU annotations'
    starts (no GPU timeline, e.g. on CPU), no busy figure."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu_marks = [e for e in events if e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith(PREFIX)]
    host_marks = [e for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith(PREFIX)]
    kernels = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
               if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e]
    waits: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "kernel" and "nccl" in e.get("name", "").lower():
            key = e["name"].split("(")[0][:60]
            waits[key] = waits.get(key, 0.0) + float(e.get("dur", 0)) / 1e3
    clock = "gpu" if gpu_marks and kernels else "host"
    marks = sorted(gpu_marks if clock == "gpu" else host_marks, key=lambda e: float(e["ts"]))
    if not marks:
        return {"clock": clock, "step_ms": 0.0, "busy_ms": None, "phases": [], "waits": waits}
    ends = [float(e["ts"]) + float(e.get("dur", 0)) for e in marks]
    t0 = min([float(marks[0]["ts"])] + ([k[0] for k in kernels] if clock == "gpu" else []))
    t1 = max(ends + ([k[1] for k in kernels] if clock == "gpu" else []))
    starts = [float(e["ts"]) for e in marks] + [t1]
    phases = []
    for i, e in enumerate(marks):
        s, d = (t0 if i == 0 else starts[i]), starts[i + 1] - (t0 if i == 0 else starts[i])
        row = {"name": e["name"][len(PREFIX):], "start_ms": (s - t0) / 1e3, "ms": d / 1e3, "busy_ms": None,
               "idle_ms": None}
        if clock == "gpu":
            inside = [(max(a, s), min(b, s + d)) for a, b in kernels if b > s and a < s + d]
            busy = _merged_busy(inside) / 1e3
            row.update(busy_ms=busy, idle_ms=max(d / 1e3 - busy, 0.0))
        phases.append(row)
    return {"clock": clock, "step_ms": (t1 - t0) / 1e3,
            "busy_ms": _merged_busy(kernels) / 1e3 if clock == "gpu" else None, "phases": phases,
            "waits": dict(sorted(waits.items(), key=lambda kv: -kv[1]))}


def format_timeline(tl: dict, title: Optional[str] = None) -> str:
    """The timeline as a markdown table (what dflash-report prints and the trainer logs)."""
    busy = f", kernels busy {tl['busy_ms']:.1f} ms" if tl.get("busy_ms") is not None else ""
    lines = [f"{title or 'step'}: {tl['step_ms']:.1f} ms ({tl['clock']} clock){busy}",
             "| phase | start ms | ms | kernels busy ms | idle ms |", "| --- | --- | --- | --- | --- |"]
    for p in tl["phases"]:
        busy_ms = "-" if p["busy_ms"] is None else f"{p['busy_ms']:.1f}"
        idle_ms = "-" if p["idle_ms"] is None else f"{p['idle_ms']:.1f}"
        lines.append(f"| {p['name']} | {p['start_ms']:.1f} | {p['ms']:.1f} | {busy_ms} | {idle_ms} |")
    if tl.get("waits"):
        lines.append("NCCL kernels (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in tl["waits"].items()))
    return "\n".join(lines)
