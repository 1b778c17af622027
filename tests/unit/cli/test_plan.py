"""The split arithmetic, topology.target_ranks=auto in a real torchrun job, and dflash-plan (CPU, tiny default)."""

import json
import os
import shutil
import subprocess
import sys
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from launch_util import REPO, free_port, torchrun

from dflash_dist.autosplit import auto_split, choose_split, format_splits, wait_for
from dflash_dist.config import ConfigError, JobConfig, validate_job


def best_by_hand(w, s, d):
    """max over T of min(T s, (W-T) d), ties to fewer targets, written independently of plan.py."""
    best_t, best_rate = None, -1.0
    for t in range(1, w):
        rate = min(t * s, (w - t) * d)
        if rate > best_rate:
            best_t, best_rate = t, rate
    return best_t, best_rate


# ---------------------------------------------------------------------------------------------- arithmetic

def test_more_targets_than_drafters():
    r = choose_split(4, 1.0, 3.0)  # T=1: min(1, 9) = 1; T=2: min(2, 6) = 2; T=3: min(3, 3) = 3
    assert [x["samples_per_s"] for x in r["rows"]] == [1.0, 2.0, 3.0]
    assert (r["target_ranks"], r["drafter_ranks"]) == (3, 1)
    assert r["predicted_samples_per_s"] == 3.0 and r["bottleneck"] == "both"
    assert [x["bottleneck"] for x in r["rows"]] == ["target", "target", "both"]


def test_fewer_targets_than_drafters():
    r = choose_split(8, 40.0, 6.0)  # T=1: min(40, 42) = 40; T=2: min(80, 36) = 36; ...
    assert (r["target_ranks"], r["drafter_ranks"]) == (1, 7)
    assert r["predicted_samples_per_s"] == 40.0 and r["bottleneck"] == "target"
    assert r["rows"][1]["samples_per_s"] == 36.0 and r["rows"][1]["bottleneck"] == "drafter"
    assert r["best"]["per_gpu"] == 5.0
    assert r["continuous_optimum_targets"] == pytest.approx(8 * 6 / 46)


@pytest.mark.parametrize("w,s,d,t", [(5, 1.0, 3.0, 3),   # T=3: min(3, 6) = 3 = T=4: min(4, 3)
                                     (3, 1.0, 1.0, 1),   # T=1: min(1, 2) = 1 = T=2: min(2, 1)
                                     (4, 2.0, 2.0, 2)])  # T=2: 4 > T=1, T=3: 2 (no tie: the middle)
def test_ties_go_to_fewer_targets(w, s, d, t):
    r = choose_split(w, s, d)
    assert r["target_ranks"] == t
    assert (t, r["predicted_samples_per_s"]) == best_by_hand(w, s, d)


def test_idle_target_capacity_is_shown():
    """The H200 rates at SpecForge's config: 8 GPUs -> 2 + 6, the targets 58% loaded."""
    r = choose_split(8, 81.3, 15.67)
    assert (r["target_ranks"], r["drafter_ranks"]) == (2, 6)
    assert r["best"]["target_util"] == pytest.approx(6 * 15.67 / (2 * 81.3)) and r["best"]["drafter_util"] == 1.0
    chosen = [line for line in format_splits(r).splitlines() if "<- chosen" in line]
    assert len(chosen) == 1 and " 58% " in chosen[0] and " 100% " in chosen[0], format_splits(r)


def test_two_ranks_have_one_split():
    for s, d in [(100.0, 1.0), (1.0, 100.0), (3.0, 3.0)]:
        r = choose_split(2, s, d)
        assert len(r["rows"]) == 1 and (r["target_ranks"], r["drafter_ranks"]) == (1, 1)
        assert r["predicted_samples_per_s"] == min(s, d)


def test_bad_inputs():
    with pytest.raises(ValueError, match="at least 2"):
        choose_split(1, 1.0, 1.0)
    with pytest.raises(ValueError, match="positive"):
        choose_split(4, 0.0, 1.0)


def test_target_ranks_validation():
    base = {"target": {"hf_config": {"builtin": "tiny"}}}
    assert JobConfig.from_dict({**base, "topology": {"target_ranks": "auto"}}).topology.target_ranks == "auto"
    assert JobConfig.from_dict({**base, "topology": {"target_ranks": "2"}}).topology.target_ranks == 2
    for bad in (0, -1, 1.5, True, "Auto", "two"):
        with pytest.raises(ConfigError, match="target_ranks"):
            JobConfig.from_dict({**base, "topology": {"target_ranks": bad}})
    auto = JobConfig.from_dict({**base, "topology": {"target_ranks": "auto"}})
    with pytest.raises(ConfigError, match="auto needs at least 2 processes"):
        validate_job(auto, 1, 8, 2048, 3)
    assert validate_job(auto, 2, 8, 2048, 3) == [1, 2, 3, 4, 5]
    big = JobConfig.from_dict({**base, "topology": {"target_ranks": 7}})
    assert validate_job(big, None, 8, 2048, 3) == [1, 2, 3, 4, 5]  # dflash-plan: no world, no split check


def test_store_wait_names_the_silent_or_failed_rank():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=10))
    with pytest.raises(RuntimeError, match=r"rank 2 did not report its target supply within 0 s"):
        wait_for(store, "supply", 2, "its target supply", 0.3)
    store.set("dflash/plan/supply", json.dumps({"error": "OutOfMemoryError: boom"}))
    with pytest.raises(RuntimeError, match="rank 2 failed while measuring its target supply: OutOfMemoryError: boom"):
        wait_for(store, "supply", 2, "its target supply", 5)
    store.set("dflash/plan/choice", json.dumps({"target_ranks": 3}))
    assert wait_for(store, "choice", 0, "the chosen split", 5) == {"target_ranks": 3}


def test_two_ranks_measure_nothing(tmp_path):
    job = SimpleNamespace(cfg=JobConfig.from_dict({"target": {"hf_config": {"builtin": "tiny"}},
                                                   "topology": {"target_ranks": "auto"}}), run_dir=str(tmp_path))
    res = auto_split(job, rank=0, world=2, device=None)  # no store, no device: nothing is measured
    assert (res["target_ranks"], res["drafter_ranks"], res["measured"]) == (1, 1, False)
    assert json.load(open(tmp_path / "plan.json")) == res


# ---------------------------------------------------------------------------------------------- real runs

@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    """One tokenized dataset for both runs below (same config -> same cache key)."""
    return tmp_path_factory.mktemp("data_cache")


def check_measured(res, world, n_target, n_drafter):
    s, d = res["supply"], res["demand"]
    assert s["batches"] == n_target and d["steps"] == n_drafter
    assert s["warmup_batches"] == 1 and d["warmup_steps"] == 1 and d["backend"] == "sdpa"
    assert s["capture"] == "padded (sdpa), compiled layers: no"  # the path the job's target runs (CPU: auto = off)
    assert s["samples"] > 0 and d["samples"] > 0 and s["tokens"] > s["samples"]
    assert s["samples_per_s"] == pytest.approx(s["samples"] / s["seconds"])
    assert s["tokens_per_s"] == pytest.approx(s["tokens"] / s["seconds"])
    assert d["samples_per_s"] == pytest.approx(d["samples"] / d["seconds"])
    n = min(n_target, n_drafter)
    assert s["messages"][:n] == d["messages"][:n]  # both sides timed the same messages of the plan
    sup, dem = s["samples_per_s"], d["samples_per_s"]
    rows = res["rows"]
    assert [r["targets"] for r in rows] == list(range(1, world))
    for r in rows:
        assert r["samples_per_s"] == pytest.approx(min(r["targets"] * sup, (world - r["targets"]) * dem))
    t, rate = best_by_hand(world, sup, dem)
    assert (res["target_ranks"], res["drafter_ranks"]) == (t, world - t)
    assert res["predicted_samples_per_s"] == pytest.approx(rate)
    return t


def test_auto_split_job(tmp_path, data_cache):
    r = torchrun(3, ["-m", "dflash_dist.train", f"train.output_dir={tmp_path}", f"data.cache_dir={data_cache}",
                     "topology.target_ranks=auto", "topology.plan_target_batches=4", "topology.plan_drafter_steps=3",
                     "train.max_steps=4", "train.eval_prompts=0", "logging.log_every=2",
                     "logging.progress_bar=false"], timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    plan = json.load(open(tmp_path / "plan.json"))
    assert plan["measured"] is True and plan["world_size"] == 3
    assert plan["measured_on"] == {"drafter": 0, "target": 2}
    t = check_measured(plan, 3, 4, 3)
    assert "topology.target_ranks=auto: measured in" in out
    assert f"chosen: {t} target + {3 - t} drafter ranks" in out
    # metrics.jsonl (and wandb) carry the same numbers
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    (rec,) = [x for x in recs if x["kind"] == "plan"]
    assert rec["target_ranks"] == t and rec["drafter_ranks"] == 3 - t
    assert rec["supply_samples_per_s"] == plan["supply"]["samples_per_s"]
    assert rec["demand_samples_per_s"] == plan["demand"]["samples_per_s"]
    assert rec["predicted_samples_per_s"] == plan["predicted_samples_per_s"]
    assert rec["bottleneck"] == plan["bottleneck"]
    # the job ran with the roles plan.json names
    targets = list(range(3 - t, 3))
    for rank in range(3):
        role, other = ("target", "drafter") if rank in targets else ("drafter", "target")
        assert f"[rank {rank} {role}]" in out and f"[rank {rank} {other}]" not in out
    assert f"topology: 3 ranks: drafters {list(range(3 - t))} (data-parallel), targets {targets}" in out
    train = [x for x in recs if x["kind"] == "train"]
    assert train[-1]["step"] == 4
    assert {k for k in train[-1] if k.endswith("_busy_frac") and k.startswith("target")} == \
        {f"target{rank}_busy_frac" for rank in targets}
    assert json.load(open(tmp_path / "config.json"))["topology"]["target_ranks"] == "auto"


def _plan_cmd():
    """The installed console script (pyproject [project.scripts]); python -m on a checkout without it."""
    exe = shutil.which("dflash-plan", path=os.path.dirname(sys.executable)) or shutil.which("dflash-plan")
    return [exe] if exe else [sys.executable, "-m", "dflash_dist.cli.plan"]


def test_dflash_plan_cli(tmp_path, data_cache):
    out_json = tmp_path / "out" / "plan.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    r = subprocess.run(_plan_cmd() + ["--gpus", "2,3,8", "--out", str(out_json), f"train.output_dir={tmp_path}",
                                      f"data.cache_dir={data_cache}", "topology.plan_target_batches=3",
                                      "topology.plan_drafter_steps=3"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    res = json.load(open(out_json))
    assert [s["world_size"] for s in res["splits"]] == [2, 3, 8]
    for w, split in zip([2, 3, 8], res["splits"]):
        check_measured({**split, "supply": res["supply"], "demand": res["demand"]}, w, 3, 3)
    lines = r.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:3] == ["GPUs", "targets", "drafters"])
    for i, b in enumerate(res["best"]):
        cells = lines[head + 1 + i].split()
        assert [int(c) for c in cells[:3]] == [b["world_size"], b["target_ranks"], b["drafter_ranks"]]
        assert float(cells[3]) == pytest.approx(b["predicted_samples_per_s"], rel=1e-3)
    assert not (tmp_path / "config.json").exists()  # a plan is not a run: only the data cache is shared

    bad = subprocess.run(_plan_cmd() + ["--gpus", "1"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "every world size must be >= 2" in bad.stderr
