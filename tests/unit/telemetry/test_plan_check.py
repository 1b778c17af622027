"""Planned vs measured samples/s of a job started from a plan (telemetry/plan_check.py)."""

from types import SimpleNamespace

import pytest

from dflash_dist.telemetry.metrics import run_summary
from dflash_dist.telemetry.plan_check import PlanCheck, plan_check_for, plan_line


def test_measured_is_the_median_steady_window():
    pc = PlanCheck(20.0, warmup_steps=10, source="topology.plan=p.json")
    for step, sps in [(1, 5.0), (10, 12.0), (20, 21.0), (30, 30.0), (40, 22.0)]:
        pc.add(step, sps)
    rec = pc.record()
    assert rec["measured_samples_per_s"] == 22.0 and rec["measured_windows"] == 3  # steps 20, 30, 40
    assert (rec["measured_samples_per_s_min"], rec["measured_samples_per_s_max"]) == (21.0, 30.0)
    assert rec["planned_samples_per_s"] == 20.0 and rec["measured_over_planned"] == pytest.approx(1.1)
    line = plan_line(rec)
    assert "planned 20.0 samples/s, measured 22.0 samples/s" in line and "topology.plan=p.json" in line
    assert line in run_summary(stopped=False, steps=40, steps_this_run=40, samples=100, wall_s=5.0, loss=1.0,
                               tau=None, checkpoint=None, metrics_path="m", wandb_dir=None, wandb_mode="disabled",
                               plan=line)


def test_a_run_shorter_than_its_warm_up_says_so():
    pc = PlanCheck(20.0, warmup_steps=10, source="auto")
    pc.add(1, 5.0)
    pc.add(5, 9.0)
    assert pc.record() is None and "no steady window" in plan_line(None)


def test_only_jobs_from_a_plan_check():
    job = SimpleNamespace(auto_split=None, start_step=3, cfg=SimpleNamespace(logging=SimpleNamespace(log_every=10)))
    assert plan_check_for(job) is None
    job.auto_split = {"world_size": 2, "measured": False}  # 2 ranks: nothing measured, nothing predicted
    assert plan_check_for(job) is None
    job.auto_split = {"predicted_samples_per_s": 7.0}
    pc = plan_check_for(job)
    assert pc.planned == 7.0 and pc.warmup_steps == 13 and pc.source == "topology.target_ranks=auto"
