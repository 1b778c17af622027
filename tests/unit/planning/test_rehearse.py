"""The CPU plan's rehearsal arithmetic: which metrics windows are steady, their summary, the choice among rehearsed
splits, and the threads a rehearsal's ranks get (planning/rehearse.py)."""

import json
import os
from types import SimpleNamespace

import pytest

from dflash_dist.planning import rehearse as rh


def window(step, sps, target_cap=None, drafter_cap=None):
    r = {"kind": "train", "step": step, "samples_per_s": sps}
    if target_cap:
        r["target_capacity_samples_per_s"] = target_cap
    if drafter_cap:
        r["drafter_capacity_samples_per_s"] = drafter_cap
    return r


def test_the_warm_up_windows_are_left_out():
    recs = [{"kind": "plan", "step": 0}, window(1, 5.0), window(4, 9.0), window(8, 20.0), window(12, 22.0),
            {"kind": "accounting", "step": 12, "samples_per_s": 1.0}]
    assert [w["step"] for w in rh.steady_windows(recs, 4)] == [8, 12]
    assert [w["step"] for w in rh.steady_windows(recs, 0)] == [1, 4, 8, 12]  # first steps: nothing left out


def test_window_summary_is_median_min_max_and_per_rank_capacity():
    ws = [window(8, 20.0, 60.0, 21.0), window(12, 24.0, 50.0, 25.0), window(16, 21.0, 70.0, 22.0)]
    s = rh.window_summary(ws, targets=1, drafters=2)
    assert (s["samples_per_s"], s["samples_per_s_min"], s["samples_per_s_max"]) == (21.0, 20.0, 24.0)
    assert s["rounds"] == 3 and s["window_rates"] == [20.0, 21.0, 24.0]
    assert s["supply_per_rank"] == 60.0 and s["demand_per_rank"] == 11.0  # medians 60 / 1 target, 22 / 2
    with pytest.raises(RuntimeError, match="no training window after its warm-up"):
        rh.window_summary([], 1, 2)


def run(t, d, med, lo, hi, sup=30.0, dem=10.0):
    return {"targets": t, "drafters": d, "samples_per_s": med, "samples_per_s_min": lo, "samples_per_s_max": hi,
            "supply_per_rank": sup, "demand_per_rank": dem}


def test_the_fastest_rehearsal_wins_unless_fewer_targets_tie():
    res = rh.split_from_rehearsals(4, [run(1, 3, 20.0, 19.0, 21.0), run(2, 2, 26.0, 25.0, 27.0),
                                       run(3, 1, 10.0, 9.0, 11.0)])
    assert (res["target_ranks"], res["drafter_ranks"], res["predicted_samples_per_s"]) == (2, 2, 26.0)
    assert not res["near_tie"] and [r["targets"] for r in res["rows"]] == [1, 2, 3]
    row = res["rows"][0]
    assert row["supply"] == 30.0 and row["demand"] == 30.0 and row["bottleneck"] == "both"
    # the fastest one's slowest window (23) is reached by 1 target: a near-tie, the fewer targets win
    tie = rh.split_from_rehearsals(4, [run(1, 3, 24.0, 22.0, 25.0), run(2, 2, 26.0, 23.0, 27.0)])
    assert tie["target_ranks"] == 1 and tie["near_tie"] and tie["fastest_targets"] == 2


def test_rehearsal_steps_and_first_steps_switch(monkeypatch):
    topo = SimpleNamespace(plan_drafter_steps=4, plan_rounds=5)
    monkeypatch.delenv(rh.FIRST_STEPS_ENV, raising=False)
    assert rh.rehearsal_steps(topo) == (4, 4, 24)  # windows of 4 after a warm-up window of 4
    monkeypatch.setenv(rh.FIRST_STEPS_ENV, "1")
    assert rh.rehearsal_steps(topo) == (1, 0, 5)  # the first 5 steps, one window each


def test_job_threads_are_dflash_trains(monkeypatch):
    from dflash_dist.cli.train import rank_environment
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for world in (1, 2, 3, 8):
        expected = rh.job_threads(world)
        rank_environment(world)  # what the ranks of a dflash-train job get
        assert int(os.environ.pop("OMP_NUM_THREADS")) == expected
    assert rh.job_threads(3, {"OMP_NUM_THREADS": "4"}) == 4


def test_rehearse_runs_the_job_with_the_splits_threads_and_reads_its_windows(monkeypatch):
    seen = {}

    def fake_run(cmd, env, capture_output, text, timeout):
        seen["cmd"], seen["env"] = cmd, env
        out = next(a.split("=", 1)[1] for a in cmd if a.startswith("train.output_dir="))
        with open(f"{out}/metrics.jsonl", "w") as f:
            for step, sps in [(1, 3.0), (2, 9.0), (4, 20.0), (6, 22.0), (8, 21.0)]:
                f.write(json.dumps(window(step, sps, 50.0, 22.0)) + "\n")
        return SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(rh.subprocess, "run", fake_run)
    monkeypatch.delenv(rh.FIRST_STEPS_ENV, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    cfg = SimpleNamespace(topology=SimpleNamespace(plan_drafter_steps=2, plan_rounds=3))
    res = rh.rehearse(cfg, ["drafter.num_layers=1", "train.output_dir=/elsewhere", "train.max_steps=9"], 3, 1,
                      "/cache", 60)
    cmd = seen["cmd"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "3" and "drafter.num_layers=1" in cmd
    assert "train.output_dir=/elsewhere" not in cmd and "train.max_steps=9" not in cmd  # the rehearsal's own win
    for o in ("topology.target_ranks=1", "train.max_steps=8", "logging.log_every=2", "data.cache_dir=/cache",
              "train.eval_prompts=0"):
        assert o in cmd
    assert seen["env"]["OMP_NUM_THREADS"] == "3" and res["threads_per_rank"] == 3
    assert res["window_rates"] == [20.0, 21.0, 22.0] and res["samples_per_s"] == 21.0  # steps 4, 6, 8
    assert (res["targets"], res["drafters"], res["warmup_steps"], res["steps"]) == (1, 2, 2, 8)
    assert res["demand_per_rank"] == 11.0 and res["supply_per_rank"] == 50.0

    monkeypatch.setattr(rh.subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=1, stdout="boom",
                                                                             stderr=""))
    with pytest.raises(RuntimeError, match="rehearsal of 1 target \\+ 2 drafter ranks exited 1:\nboom"):
        rh.rehearse(cfg, [], 3, 1, "/cache", 60)
