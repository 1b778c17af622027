"""A job started from a plan (``topology.target_ranks=auto``, or with ``topology.plan=plan.json``) states the plan's
prediction next to what it then measures: "planned X samples/s, measured Y samples/s".

Measured is the job's steady rate, the same statistic dflash-plan predicts on CPU (planning/rehearse.py): the
median of the metrics windows' samples/s, leaving out the first window and every window that ends within the
first ``logging.log_every`` steps (start-up, connects, the first steps)."""

from __future__ import annotations

import statistics
from typing import Optional


class PlanCheck:
    """The leader's windows (step, samples/s) of one launch, and the plan's predicted samples/s."""

    def __init__(self, planned: float, warmup_steps: int, source: str):
        self.planned, self.warmup_steps, self.source = float(planned), int(warmup_steps), source
        self.windows: list[tuple[int, float]] = []

    def add(self, step: int, samples_per_s: float) -> None:
        self.windows.append((int(step), float(samples_per_s)))

    def record(self) -> Optional[dict]:
        """The ``kind: plan_check`` record (None before any steady window)."""
        steady = [r for s, r in self.windows[1:] if s > self.warmup_steps]
        if not steady:
            return None
        steady.sort()
        measured = statistics.median(steady)
        return {"planned_samples_per_s": self.planned, "measured_samples_per_s": measured,
                "measured_samples_per_s_min": steady[0], "measured_samples_per_s_max": steady[-1],
                "measured_windows": len(steady), "warmup_steps": self.warmup_steps,
                "measured_over_planned": measured / self.planned if self.planned > 0 else None,
                "plan_source": self.source}


def plan_line(rec: Optional[dict]) -> str:
    """The line of the run's summary (and log) for a ``record``; says so when nothing steady was measured."""
    if rec is None:
        return "plan: no steady window measured (the run was shorter than its warm-up)"
    return (f"plan: planned {rec['planned_samples_per_s']:.1f} samples/s, measured "
            f"{rec['measured_samples_per_s']:.1f} samples/s (median of {rec['measured_windows']} windows after step "
            f"{rec['warmup_steps']}; min {rec['measured_samples_per_s_min']:.1f}, max "
            f"{rec['measured_samples_per_s_max']:.1f}; measured/planned {rec['measured_over_planned']:.2f}; "
            f"from {rec['plan_source']})")


def plan_check_for(job) -> Optional[PlanCheck]:
    """A PlanCheck for a job whose split came from a plan with a predicted rate, else None."""
    plan = getattr(job, "auto_split", None) or {}
    if plan.get("predicted_samples_per_s") is None:
        return None
    warmup = job.start_step + job.cfg.logging.log_every
    return PlanCheck(plan["predicted_samples_per_s"], warmup, plan.get("source", "topology.target_ranks=auto"))
