"""dflash-plan predicts the job: on the default config, the plan of the 1 target + 2 drafter split, then the real job
started from that plan.json right after on the same machine; the plan's predicted samples/s is within 20% of the
job's measured steady samples/s, and the job states both ("planned X samples/s, measured Y samples/s"). A plan
measured on the first steps (no warm-up window) misses by more than that."""

import json
import os
import subprocess
import sys

from helpers.launch_util import REPO, torchrun

TOLERANCE = 0.20
# the plan rehearses the job's first 60 steps: a warm-up window of 10 steps, then 5 windows of 10 (the job's
# logging.log_every); the job then measures its 5 windows after step 10 of the same batches
PLAN = ["topology.plan_drafter_steps=10", "topology.plan_rounds=5"]
JOB_STEPS = 60
FIRST_STEPS = ["topology.plan_rounds=2"]  # timed on its first 2 steps, one window each, nothing left out


def run_plan(out_json, cache, first_steps: bool, extra=()):
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="disabled")
    env.pop("OMP_NUM_THREADS", None)  # the plan sets each rehearsal rank's threads as dflash-train would
    if first_steps:
        env["DFLASH_PLAN_FIRST_STEPS"] = "1"
    r = subprocess.run([sys.executable, "-m", "dflash_dist.cli.plan", "--gpus", "3", "--targets", "1",
                        "--out", str(out_json), f"data.cache_dir={cache}", "train.eval_prompts=0", *PLAN, *extra],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    plan = json.load(open(out_json))
    (split,) = plan["splits"]
    assert (split["world_size"], split["target_ranks"], split["drafter_ranks"]) == (3, 1, 2)
    return split


def plan_then_job(tmp_path, cache, k: int) -> tuple:
    """The plan, then the job started from it: (planned, measured) samples/s, the rehearsal, the job's check."""
    plan_json = tmp_path / f"plan{k}.json"
    split = run_plan(plan_json, cache, first_steps=False)
    (run,) = split["rehearsals"]
    assert run["warmup_steps"] == 10 and run["rounds"] == 5 and run["threads_per_rank"] >= 1
    assert run["samples_per_s_min"] <= run["samples_per_s"] <= run["samples_per_s_max"]
    planned = split["predicted_samples_per_s"]

    out = tmp_path / f"job{k}"
    r = torchrun(3, ["-m", "dflash_dist.train", f"train.output_dir={out}", f"data.cache_dir={cache}",
                     "topology.target_ranks=auto", f"topology.plan={plan_json}", f"train.max_steps={JOB_STEPS}",
                     "train.eval_prompts=0", "logging.progress_bar=false", "logging.wandb.mode=disabled"],
                 timeout=600, env={"OMP_NUM_THREADS": str(run["threads_per_rank"])})  # the rehearsal's threads
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert "topology: 3 ranks: drafters [0, 1] (data-parallel), targets [2]" in log
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    (check,) = [x for x in recs if x["kind"] == "plan_check"]
    (rec,) = [x for x in recs if x["kind"] == "plan"]
    assert rec["source"] == f"topology.plan={plan_json}" and rec["predicted_samples_per_s"] == planned
    assert check["planned_samples_per_s"] == planned and check["measured_windows"] == 5
    measured = check["measured_samples_per_s"]
    assert f"planned {planned:.1f} samples/s, measured {measured:.1f} samples/s" in log
    print(f"planned {planned:.2f}, measured {measured:.2f} samples/s "
          f"(plan windows {run['window_rates']}; job min {check['measured_samples_per_s_min']:.2f}, "
          f"max {check['measured_samples_per_s_max']:.2f})")
    return planned, measured


def test_plan_predicts_the_job(tmp_path):
    """A shared 2-core machine's speed drifts between two runs a minute apart (one CI run: planned 59.3, the job
    47.7 samples/s, its windows 43.8-58.4): when the first plan and job miss, a second pair is measured, and it
    must hit."""
    cache = tmp_path / "cache"
    planned, measured = plan_then_job(tmp_path, cache, 0)
    if abs(planned / measured - 1) > TOLERANCE:
        planned, measured = plan_then_job(tmp_path, cache, 1)
    assert abs(planned / measured - 1) <= TOLERANCE, (planned, measured)

    # the same plan timed on the first steps: off by more than the tolerance
    first = run_plan(tmp_path / "first.json", cache, first_steps=True, extra=FIRST_STEPS)
    (frun,) = first["rehearsals"]
    assert frun["warmup_steps"] == 0 and frun["window_steps"] == 1 and frun["rounds"] == 2
    print(f"first steps: planned {first['predicted_samples_per_s']:.2f} samples/s (windows {frun['window_rates']})")
    assert abs(first["predicted_samples_per_s"] / measured - 1) > TOLERANCE, (first["predicted_samples_per_s"],
                                                                             measured)
