"""The split arithmetic, topology.target_ranks=auto in a real torchrun job, and dflash-plan (CPU, tiny default)."""

import json
import os
import shutil
import statistics
import subprocess
import sys
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from helpers.launch_util import REPO, free_port, torchrun
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_dist.cli.plan import format_best
from dflash_dist.config import ConfigError, JobConfig, split_targets, validate_job
from dflash_dist.planning.split import (
    MAX_ROUNDS_FACTOR,
    choose_split,
    format_rates,
    format_splits,
    rate_summary,
    timed_rounds,
)
from dflash_dist.planning.startup import wait_for


def splits(*args, **kw):
    """The T + D splits alone (what these arithmetic tests check); colocated beside them: its own tests below."""
    return choose_split(*args, colocated=False, **kw)


def colocated_by_hand(w, s, d):
    """W ranks each capturing (1/s per sample) then training (1/d): W / (1/s + 1/d)."""
    return w / (1 / s + 1 / d)


def best_by_hand(w, s, d):
    """max over T of min(T s, (W-T) d), ties to fewer targets, written independently of plan.py."""
    best_t, best_rate = None, -1.0
    for t in range(1, w):
        rate = min(t * s, (w - t) * d)
        if rate > best_rate:
            best_t, best_rate = t, rate
    return best_t, best_rate


def choice_by_hand(w, s, d, s_range, d_range):
    """The near-tie rule, written independently of plan.py: the fastest split by the medians (fewest targets
    among equals); its rate with both sides at their slowest round is the floor; the fewest targets whose
    median prediction reaches the floor win."""
    rates = {t: min(t * s, (w - t) * d) for t in range(1, w)}
    t_fast = min(t for t in rates if rates[t] == max(rates.values()))
    floor = min(t_fast * s_range[0], (w - t_fast) * d_range[0])
    return min(t for t in rates if rates[t] >= floor)


# ---------------------------------------------------------------------------------------------- arithmetic

def test_more_targets_than_drafters():
    r = splits(4, 1.0, 3.0)  # T=1: min(1, 9) = 1; T=2: min(2, 6) = 2; T=3: min(3, 3) = 3
    assert [x["samples_per_s"] for x in r["rows"]] == [1.0, 2.0, 3.0]
    assert (r["target_ranks"], r["drafter_ranks"]) == (3, 1)
    assert r["predicted_samples_per_s"] == 3.0 and r["bottleneck"] == "both"
    assert [x["bottleneck"] for x in r["rows"]] == ["target", "target", "both"]


def test_fewer_targets_than_drafters():
    r = splits(8, 40.0, 6.0)  # T=1: min(40, 42) = 40; T=2: min(80, 36) = 36; ...
    assert (r["target_ranks"], r["drafter_ranks"]) == (1, 7)
    assert r["predicted_samples_per_s"] == 40.0 and r["bottleneck"] == "target"
    assert r["rows"][1]["samples_per_s"] == 36.0 and r["rows"][1]["bottleneck"] == "drafter"
    assert r["best"]["per_gpu"] == 5.0
    assert r["continuous_optimum_targets"] == pytest.approx(8 * 6 / 46)


@pytest.mark.parametrize("w,s,d,t", [(5, 1.0, 3.0, 3),   # T=3: min(3, 6) = 3 = T=4: min(4, 3)
                                     (3, 1.0, 1.0, 1),   # T=1: min(1, 2) = 1 = T=2: min(2, 1)
                                     (4, 2.0, 2.0, 2)])  # T=2: 4 > T=1, T=3: 2 (no tie: the middle)
def test_ties_go_to_fewer_targets(w, s, d, t):
    r = splits(w, s, d)
    assert r["target_ranks"] == t
    assert (t, r["predicted_samples_per_s"]) == best_by_hand(w, s, d)


def test_idle_target_capacity_is_shown():
    """The H200 rates at SpecForge's config: 8 GPUs -> 2 + 6, the targets 58% loaded."""
    r = splits(8, 81.3, 15.67)
    assert (r["target_ranks"], r["drafter_ranks"]) == (2, 6)
    assert r["best"]["target_util"] == pytest.approx(6 * 15.67 / (2 * 81.3)) and r["best"]["drafter_util"] == 1.0
    chosen = [line for line in format_splits(r).splitlines() if "<- chosen" in line]
    assert len(chosen) == 1 and " 58% " in chosen[0] and " 100% " in chosen[0], format_splits(r)


def test_two_ranks_have_one_split():
    for s, d in [(100.0, 1.0), (1.0, 100.0), (3.0, 3.0)]:
        r = splits(2, s, d)
        assert len(r["rows"]) == 1 and (r["target_ranks"], r["drafter_ranks"]) == (1, 1)
        assert r["predicted_samples_per_s"] == min(s, d)


# ---------------------------------------------------------------------------------------------- measured spreads

def test_near_ties_within_the_spread_go_to_fewer_targets():
    """Two runs on one busy machine: by the medians alone the first picks 1 + 3 and the second 2 + 2 (the flip
    dflash-plan showed); with each run's measured spread both pick 1 + 3."""
    first = splits(4, 2.1, 1.0)            # T=1: min(2.1, 3) = 2.1 > T=2: min(4.2, 2) = 2
    second = splits(4, 1.95, 1.02)         # T=1: 1.95 < T=2: min(3.9, 2.04) = 2.04
    assert (first["target_ranks"], second["target_ranks"]) == (1, 2)
    a = splits(4, 2.1, 1.0, (1.9, 2.3), (0.95, 1.05))
    b = splits(4, 1.95, 1.02, (1.8, 2.2), (0.96, 1.08))
    assert (a["target_ranks"], b["target_ranks"]) == (1, 1)
    assert a["near_tie"] is False and a["fastest_targets"] == 1
    # run b: 2 + 2 is fastest by the medians (2.04) but only 1.92 with both sides at their slowest round,
    # which 1 + 3 (1.95) reaches
    assert b["near_tie"] is True and b["fastest_targets"] == 2
    assert b["rows"][1]["samples_per_s_low"] == pytest.approx(min(2 * 1.8, 2 * 0.96))
    assert b["rows"][1]["samples_per_s_high"] == pytest.approx(min(2 * 2.2, 2 * 1.08))
    assert b["predicted_samples_per_s"] == pytest.approx(1.95) and b["bottleneck"] == "target"
    text = format_splits(b)
    assert "spread (min..max)" in text and "<- fastest by the medians" in text
    assert [ln for ln in text.splitlines() if "<- chosen" in ln][0].split()[:2] == ["1", "3"]
    assert "near-tie: 2 + 2 predicts 2.04 samples/s but as little as 1.92" in text


def test_a_winner_beyond_the_spread_keeps_its_targets():
    r = splits(4, 1.5, 1.0, (1.45, 1.55), (0.98, 1.02))  # T=2: 2.0, at least 1.96 > T=1: 1.5
    assert (r["target_ranks"], r["near_tie"]) == (2, False)
    assert r["target_ranks"] == choice_by_hand(4, 1.5, 1.0, (1.45, 1.55), (0.98, 1.02))


def test_zero_spread_is_the_exact_tie_rule():
    for w, s, d in [(5, 1.0, 3.0), (3, 1.0, 1.0), (4, 2.0, 2.0), (8, 81.3, 15.67), (8, 40.0, 6.0)]:
        r = splits(w, s, d, (s, s), (d, d))
        assert (r["target_ranks"], r["predicted_samples_per_s"]) == best_by_hand(w, s, d)
        assert r["near_tie"] is False


@settings(max_examples=300, deadline=None)
@given(w=st.integers(2, 12), s=st.floats(0.1, 100), d=st.floats(0.1, 100),
       s_lo=st.floats(0.5, 1), s_hi=st.floats(1, 2), d_lo=st.floats(0.5, 1), d_hi=st.floats(1, 2))
def test_spread_choice_matches_the_rule_by_hand(w, s, d, s_lo, s_hi, d_lo, d_hi):
    sr, dr = (s * s_lo, s * s_hi), (d * d_lo, d * d_hi)
    sr, dr = (min(sr[0], s), max(sr[1], s)), (min(dr[0], d), max(dr[1], d))  # float rounding at factor 1
    r = splits(w, s, d, sr, dr)
    assert r["target_ranks"] == choice_by_hand(w, s, d, sr, dr)
    fast = r["rows"][r["fastest_targets"] - 1]
    assert r["target_ranks"] <= r["fastest_targets"] and r["predicted_samples_per_s"] >= fast["samples_per_s_low"]
    assert all(x["samples_per_s_low"] <= x["samples_per_s"] <= x["samples_per_s_high"] for x in r["rows"])


def test_bad_spreads():
    with pytest.raises(ValueError, match="supply spread"):
        splits(4, 1.0, 1.0, (1.1, 1.2), None)   # the median outside its own spread
    with pytest.raises(ValueError, match="demand spread"):
        splits(4, 1.0, 1.0, None, (0.0, 1.0))


def test_timed_rounds_repeat_until_long_enough():
    """No real timing: a fake clock that each pass advances by the next duration."""
    durations, now = iter([0.1] * 100), [0.0]

    def one_pass():
        now[0] += next(durations)

    clock = lambda: now[0]  # noqa: E731
    assert timed_rounds(one_pass, 3, 0.0, clock) == pytest.approx([0.1] * 3)           # rounds enough
    assert len(timed_rounds(one_pass, 3, 1.0, clock)) == 10                            # 10 x 0.1 s reach 1 s
    assert len(timed_rounds(one_pass, 2, 100.0, clock)) == 2 * MAX_ROUNDS_FACTOR        # capped


def test_rate_summary_and_its_printout():
    m = rate_summary([2.0, 1.0, 4.0, 1.0, 2.0], samples=8, tokens=80)  # rates 4, 8, 2, 8, 4
    assert m["samples_per_s"] == 4.0 and m["tokens_per_s"] == 40.0
    assert (m["samples_per_s_min"], m["samples_per_s_max"], m["rounds"], m["seconds"]) == (2.0, 8.0, 5, 10.0)
    common = {"batches": 3, "warmup_batches": 1, "device": "cpu", "steps": 3, "warmup_steps": 1,
              "backend": "sdpa"}
    text = format_rates({**m, **common}, {**m, **common})
    assert text.count("[median of 5 rounds; min 2, median 4, max 8: -50%/+100%]") == 2
    r = splits(4, 4.0, 4.0, (2.0, 8.0), (2.0, 8.0))
    best = {"best": [{"world_size": 4, "target_ranks": r["target_ranks"], "drafter_ranks": r["drafter_ranks"],
                      "predicted_samples_per_s": r["predicted_samples_per_s"], "per_gpu": r["best"]["per_gpu"],
                      "target_util": r["best"]["target_util"], "bottleneck": r["bottleneck"],
                      "near_tie": r["near_tie"], "fastest_targets": r["fastest_targets"]}]}
    assert r["near_tie"] and "(near-tie: 2 targets fastest by the medians" in format_best(best)


def test_colocated_beside_every_split():
    """Colocated (0 targets) predicts W / (1/s + 1/d), never less than a split, and is chosen; ties go to it."""
    for w, s, d in [(1, 40.0, 14.0), (2, 1.0, 1.0), (8, 40.0, 6.0), (8, 81.3, 15.67), (4, 1.0, 3.0)]:
        r = choose_split(w, s, d)
        assert r["rows"][0]["targets"] == 0 and r["rows"][0]["drafters"] == w
        assert r["rows"][0]["samples_per_s"] == pytest.approx(colocated_by_hand(w, s, d))
        assert r["target_ranks"] == 0 and r["drafter_ranks"] == w and r["bottleneck"] == "colocated"
        assert all(x["samples_per_s"] <= r["predicted_samples_per_s"] + 1e-9 for x in r["rows"])
        assert [x["targets"] for x in r["rows"][1:]] == list(range(1, w))
    assert "colocated on 8 rank(s)" in format_splits(choose_split(8, 40.0, 6.0))
    # with spreads: its low and high from both sides' slowest and fastest rounds
    r = choose_split(4, 2.0, 1.0, (1.5, 2.5), (0.5, 1.5))
    assert (r["rows"][0]["samples_per_s_low"], r["rows"][0]["samples_per_s_high"]) == (
        pytest.approx(colocated_by_hand(4, 1.5, 0.5)), pytest.approx(colocated_by_hand(4, 2.5, 1.5)))
    # a replica of several ranks cannot be colocated (a whole target on every rank)
    assert 0 not in [x["targets"] for x in choose_split(8, 5.0, 4.0, tensor_parallel=2)["rows"]]


def test_bad_inputs():
    with pytest.raises(ValueError, match="at least 2"):
        splits(1, 1.0, 1.0)
    with pytest.raises(ValueError, match="positive"):
        splits(4, 0.0, 1.0)


def test_target_ranks_validation():
    base = {"target": {"hf_config": {"builtin": "tiny"}}}
    assert JobConfig.from_dict({**base, "topology": {"target_ranks": "auto"}}).topology.target_ranks == "auto"
    assert JobConfig.from_dict({**base, "topology": {"target_ranks": "2"}}).topology.target_ranks == 2
    assert JobConfig.from_dict({**base, "topology": {"target_ranks": "colocated"}}).topology.target_ranks == 0
    for bad in (-1, 1.5, True, "Auto", "two"):
        with pytest.raises(ConfigError, match="target_ranks"):
            JobConfig.from_dict({**base, "topology": {"target_ranks": bad}})
    auto = JobConfig.from_dict({**base, "topology": {"target_ranks": "auto"}})
    assert split_targets(auto, 1) == 0 and split_targets(auto, 2) == "auto"  # one process: colocated
    assert validate_job(auto, 1, 8, 2048, 3) == [1, 2, 3, 4, 5]
    assert validate_job(auto, 2, 8, 2048, 3) == [1, 2, 3, 4, 5]
    one = JobConfig.from_dict(base)  # the default, 1 target rank: colocated in a world of 1
    assert split_targets(one, 1) == 0 and split_targets(one, 3) == 1
    two = JobConfig.from_dict({**base, "topology": {"target_ranks": 2}})
    with pytest.raises(ConfigError, match=r"target_ranks=0 \(colocated"):
        validate_job(two, 2, 8, 2048, 3)
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


# ---------------------------------------------------------------------------------------------- real runs

@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    """One tokenized dataset for both runs below (same config -> same cache key)."""
    return tmp_path_factory.mktemp("data_cache")


# the real runs time 3 rounds (at least 0.5 s) of each side: the default 5 rounds / 2 s is for real jobs
FEW_ROUNDS = ["topology.plan_rounds=3", "topology.plan_min_seconds=0.5"]


def check_measured(res, world, n_target, n_drafter, rounds=3, min_seconds=0.5):
    s, d = res["supply"], res["demand"]
    assert s["batches"] == n_target and d["steps"] == n_drafter
    assert s["warmup_batches"] == n_target and d["warmup_steps"] == n_drafter and d["backend"] == "sdpa"
    assert s["capture"] == "padded (sdpa), compiled layers: no"  # the path the job's target runs (CPU: auto = off)
    assert s["samples"] > 0 and d["samples"] > 0 and s["tokens"] > s["samples"]
    for m in (s, d):  # rounds of one pass each, more until min_seconds
        assert rounds <= m["rounds"] == len(m["round_seconds"])
        assert m["seconds"] == pytest.approx(sum(m["round_seconds"]))
        assert m["seconds"] >= min_seconds or m["rounds"] == MAX_ROUNDS_FACTOR * rounds
        rates = sorted(m["samples"] / x for x in m["round_seconds"])
        assert m["samples_per_s"] == pytest.approx(statistics.median(rates))
        assert (m["samples_per_s_min"], m["samples_per_s_max"]) == (pytest.approx(rates[0]), pytest.approx(rates[-1]))
        assert m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * m["tokens"] / m["samples"])
    n = min(n_target, n_drafter)
    assert s["messages"][:n] == d["messages"][:n]  # both sides timed the same messages of the plan
    sup, dem = s["samples_per_s"], d["samples_per_s"]
    rows = res["rows"]
    assert [r["targets"] for r in rows] == list(range(0, world))  # colocated first, then every T + D split
    assert rows[0]["samples_per_s"] == pytest.approx(colocated_by_hand(world, sup, dem))
    for r in rows[1:]:
        assert r["samples_per_s"] == pytest.approx(min(r["targets"] * sup, (world - r["targets"]) * dem))
    # colocated predicts at least every split's rate, and near-ties go to fewer targets: it is chosen
    assert (res["target_ranks"], res["drafter_ranks"]) == (0, world)
    assert res["predicted_samples_per_s"] == pytest.approx(colocated_by_hand(world, sup, dem))
    return 0


def test_auto_split_job(tmp_path, data_cache):
    r = torchrun(3, ["-m", "dflash_dist.train", f"train.output_dir={tmp_path}", f"data.cache_dir={data_cache}",
                     "topology.target_ranks=auto", "topology.plan_target_batches=4", "topology.plan_drafter_steps=3",
                     *FEW_ROUNDS, "train.max_steps=4", "train.eval_prompts=0", "logging.log_every=2",
                     "logging.progress_bar=false"], timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    plan = json.load(open(tmp_path / "plan.json"))
    assert plan["measured"] is True and plan["world_size"] == 3
    assert plan["measured_on"] == {"drafter": 0, "target": 2}
    assert plan["demand"]["data_parallel_ranks"] == 2  # rank 1 trained beside rank 0, as a drafter of the job does
    assert "drafter steps on this rank, data-parallel with rank 0's measurement (ranks [0, 1])" in out
    t = check_measured(plan, 3, 4, 3)
    assert "topology.target_ranks=auto: measured in" in out
    assert "chosen: colocated on 3 rank(s)" in out
    # metrics.jsonl (and wandb) carry the same numbers
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    (rec,) = [x for x in recs if x["kind"] == "plan"]
    assert rec["target_ranks"] == t and rec["drafter_ranks"] == 3 - t
    assert rec["supply_samples_per_s"] == plan["supply"]["samples_per_s"]
    assert rec["demand_samples_per_s"] == plan["demand"]["samples_per_s"]
    assert rec["predicted_samples_per_s"] == plan["predicted_samples_per_s"]
    assert rec["bottleneck"] == plan["bottleneck"]
    assert rec["supply_samples_per_s_min"] == plan["supply"]["samples_per_s_min"]
    assert rec["demand_samples_per_s_max"] == plan["demand"]["samples_per_s_max"]
    assert rec["near_tie"] == plan["near_tie"]
    # the job states the plan's prediction next to what it measured (windows after logging.log_every=2 steps)
    (check,) = [x for x in recs if x["kind"] == "plan_check"]
    assert check["planned_samples_per_s"] == plan["predicted_samples_per_s"] and check["measured_windows"] == 1
    assert (f"planned {check['planned_samples_per_s']:.1f} samples/s, measured "
            f"{check['measured_samples_per_s']:.1f} samples/s" in out)
    assert out.count("rounds; min ") == 2 and "spread (min..max)" in out  # the spread is printed
    # the job ran colocated, as plan.json names: every rank both roles
    for rank in range(3):
        assert f"[rank {rank} colocated]" in out and f"[rank {rank} target]" not in out
    assert "topology: 3 colocated rank(s)" in out
    train = [x for x in recs if x["kind"] == "train"]
    assert train[-1]["step"] == 4
    # the leader's own target half (a colocated rank's stats travel to its own drafter half only)
    assert {k for k in train[-1] if k.endswith("_busy_frac") and k.startswith("target")} == {"target0_busy_frac"}
    assert json.load(open(tmp_path / "config.json"))["topology"]["target_ranks"] == "auto"


def _plan_cmd():
    """The installed console script (pyproject [project.scripts]); python -m on a checkout without it."""
    exe = shutil.which("dflash-plan", path=os.path.dirname(sys.executable)) or shutil.which("dflash-plan")
    return [exe] if exe else [sys.executable, "-m", "dflash_dist.cli.plan"]


def test_dflash_plan_cli(tmp_path, data_cache):
    out_json = tmp_path / "out" / "plan.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    r = subprocess.run(_plan_cmd() + ["--alone", "--gpus", "2,3,8", "--out", str(out_json),
                                      f"train.output_dir={tmp_path}",
                                      f"data.cache_dir={data_cache}", "topology.plan_target_batches=3",
                                      "topology.plan_drafter_steps=3", *FEW_ROUNDS],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    res = json.load(open(out_json))
    assert [s["world_size"] for s in res["splits"]] == [2, 3, 8]
    for w, split in zip([2, 3, 8], res["splits"]):
        check_measured({**split, "supply": res["supply"], "demand": res["demand"]}, w, 3, 3)
    assert r.stdout.count("rounds; min ") == 2  # both sides' spread printed (min, median, max)
    lines = r.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:3] == ["GPUs", "targets", "drafters"])
    for i, b in enumerate(res["best"]):
        cells = lines[head + 1 + i].split()
        assert [int(c) for c in cells[:3]] == [b["world_size"], b["target_ranks"], b["drafter_ranks"]]
        assert float(cells[3]) == pytest.approx(b["predicted_samples_per_s"], rel=1e-3)
    assert not (tmp_path / "config.json").exists()  # a plan is not a run: only the data cache is shared

    bad = subprocess.run(_plan_cmd() + ["--gpus", "0"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "every world size must be >= 1" in bad.stderr


def test_dflash_plan_measures_the_dflash2_drafter(tmp_path, data_cache):
    """dflash-plan --alone (each role timed on its own) with drafter=tiny_dflash2: the demand is that of a DFlash2
    drafter's full step (convolutions, selector and its loss), and every world size gets a split."""
    out_json = tmp_path / "plan.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    r = subprocess.run(PLAN_MODULE + ["--alone", "--gpus", "2,3", "--out", str(out_json),
                                      f"train.output_dir={tmp_path}", f"data.cache_dir={data_cache}",
                                      "drafter=tiny_dflash2",
                                      "topology.plan_target_batches=2", "topology.plan_drafter_steps=2", *FEW_ROUNDS],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    res = json.load(open(out_json))
    assert res["demand"]["variant"] == "dflash2" and "drafter=tiny_dflash2" in res["overrides"]
    assert [s["world_size"] for s in res["splits"]] == [2, 3]
    for w, split in zip([2, 3], res["splits"]):
        check_measured({**split, "supply": res["supply"], "demand": res["demand"]}, w, 2, 2)


def test_replica_splits_are_whole_replicas():
    res = choose_split(8, 10.0 / 2, 4.0, tensor_parallel=2)  # a replica of 2 supplies 10 samples/s
    assert [r["targets"] for r in res["rows"]] == [2, 4, 6]
    assert res["target_ranks"] == 4 and res["predicted_samples_per_s"] == pytest.approx(16.0)  # min(2 x 10, 4 x 4)
    with pytest.raises(ValueError, match="leaves no drafter"):
        choose_split(2, 1.0, 1.0, tensor_parallel=2)


PLAN_MODULE = [sys.executable, "-m", "dflash_dist.cli.plan"]  # this checkout's module, whatever is installed


def test_dflash_plan_with_a_replica_supply(tmp_path, data_cache):
    """target.tensor_parallel=2: drafter demand measured, the replica's supply given (one process cannot run a
    replica of 2, and says so without --replica-supply)."""
    out_json = tmp_path / "plan.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    common = ["--gpus", "3,5", "--out", str(out_json), f"train.output_dir={tmp_path}", f"data.cache_dir={data_cache}",
              "topology.plan_drafter_steps=2", "target.tensor_parallel=2"]
    bad = subprocess.run(PLAN_MODULE + common, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "one process cannot measure a replica of 2 ranks" in bad.stderr, bad.stderr
    r = subprocess.run(PLAN_MODULE + common + ["--replica-supply", "7.5"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    res = json.load(open(out_json))
    assert "7.5 samples/s per replica of 2 ranks (given with --replica-supply" in r.stdout
    for split in res["splits"]:
        assert all(row["targets"] % 2 == 0 for row in split["rows"])
        assert split["rows"][0]["supply"] == pytest.approx(7.5)
