"""dflash-plan on CPU: each split rehearsed as a short real job, its rate read from the job's own metrics.

On CPU the ranks of a job share the machine's cores (each with cores // W threads, as dflash-train and
launch/env.sh set them), the drafters all-reduce their gradients over gloo and every message crosses the
transport: one process timing one role alone with the whole machine predicts none of that (3-7x off on 2 cores).
So the plan runs the job itself, ``python -m torch.distributed.run --nproc-per-node W -m dflash_dist.train`` with
the plan's overrides and ``topology.target_ranks=T``, for ``(1 + plan_rounds) x plan_drafter_steps`` steps on the
first messages of the plan (the batches the job trains first), and reads its metrics windows of
``plan_drafter_steps`` steps: the first window is warm-up (start-up, connects, first steps), each later window is a
round. The job's steady rate and the plan's prediction are then the same statistic: the median window's
samples/s (``telemetry/plan_check.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Optional

# The plan's measurement of first steps (no warm-up window): kept only to show that it mispredicts.
FIRST_STEPS_ENV = "DFLASH_PLAN_FIRST_STEPS"


def job_threads(world: int, env: Optional[dict] = None) -> int:
    """Threads per rank of a CPU job of ``world`` ranks: OMP_NUM_THREADS if set, else the cores shared among the
    ranks (dflash-train's rank_environment, launch/env.sh)."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS", "").strip().isdigit():
        return max(1, int(env["OMP_NUM_THREADS"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // world)


def first_steps() -> bool:
    return os.environ.get(FIRST_STEPS_ENV) == "1"


def rehearsal_steps(topology) -> tuple[int, int, int]:
    """(window steps, warm-up steps, total steps) of one rehearsal; measuring first steps: the first
    plan_rounds steps, one window each, nothing left out."""
    if first_steps():
        return 1, 0, topology.plan_rounds
    window = topology.plan_drafter_steps
    return window, window, (1 + topology.plan_rounds) * window


def steady_windows(records: list, warmup_steps: int) -> list[dict]:
    """The training windows of a metrics.jsonl after the warm-up: those that end past ``warmup_steps``, and, with
    warm-up, not the first one (it counts from the job's start: connects, model loads, first steps)."""
    train = [r for r in records if r.get("kind") == "train" and r.get("samples_per_s")]
    if warmup_steps > 0:
        train = [r for r in train[1:] if r["step"] > warmup_steps]
    return train


def window_summary(windows: list[dict], targets: int, drafters: int) -> dict:
    """The job rate of a rehearsal: min / median / max of its windows' samples/s, and per rank the median supply
    and demand the windows measured (target and drafter capacity: what each side does per busy second)."""
    if not windows:
        raise RuntimeError("the rehearsal logged no training window after its warm-up")
    rates = sorted(w["samples_per_s"] for w in windows)

    def per_rank(key: str, n: int) -> Optional[float]:
        vals = [w[key] for w in windows if w.get(key)]
        return statistics.median(vals) / n if vals else None
    targets = targets or drafters  # colocated: every rank is a target too
    return {"samples_per_s": statistics.median(rates), "samples_per_s_min": rates[0],
            "samples_per_s_max": rates[-1], "rounds": len(rates), "window_rates": rates,
            "supply_per_rank": per_rank("target_capacity_samples_per_s", targets),
            "demand_per_rank": per_rank("drafter_capacity_samples_per_s", drafters)}


def rehearse(cfg, overrides: list[str], world: int, targets: int, cache_dir: str, timeout_s: float) -> dict:
    """One split's rehearsal (see the module docstring): runs the job, returns ``window_summary`` plus what ran."""
    window, warmup, steps = rehearsal_steps(cfg.topology)
    out = tempfile.mkdtemp(prefix=f"dflash-plan-{targets}+{world - targets}-")
    env = dict(os.environ, OMP_NUM_THREADS=str(job_threads(world)), PYTHONUNBUFFERED="1")
    env.setdefault("WANDB_MODE", "disabled")
    ours = [f"topology.target_ranks={targets}", f"train.max_steps={steps}", f"logging.log_every={window}",
            f"train.output_dir={out}", f"data.cache_dir={cache_dir}", "train.resume=none", "train.eval_prompts=0",
            "train.checkpoint_every=0", "logging.progress_bar=false", "logging.wandb.mode=disabled"]
    keys = {o.split("=", 1)[0] for o in ours}
    theirs = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in keys]  # the rehearsal's own win
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "-m", "dflash_dist.train", *theirs, *ours]
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if r.returncode != 0:
            raise RuntimeError(f"the rehearsal of {targets} target + {world - targets} drafter ranks exited "
                               f"{r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    res = window_summary(steady_windows(records, warmup), targets, world - targets)
    res.update(targets=targets, drafters=world - targets, threads_per_rank=int(env["OMP_NUM_THREADS"]),
               steps=steps, window_steps=window, warmup_steps=warmup)
    return res


def split_from_rehearsals(world: int, runs: list[dict]) -> dict:
    """The choice among rehearsed splits, by the rule of ``split.choose_split``: the fastest by the medians
    unless a split with fewer targets reaches the fastest one's slowest window (a near-tie: fewer targets win).
    The same keys as ``choose_split``, each row a rehearsal's measured rate."""
    rows = []
    for r in sorted(runs, key=lambda x: x["targets"]):
        sup = (r["supply_per_rank"] or 0.0) * (r["targets"] or r["drafters"])  # colocated: every rank captures
        dem = (r["demand_per_rank"] or 0.0) * r["drafters"]
        rate = r["samples_per_s"]
        rows.append({"targets": r["targets"], "drafters": r["drafters"], "supply": sup, "demand": dem,
                     "samples_per_s": rate, "per_gpu": rate / world,
                     "bottleneck": "colocated" if not r["targets"] else
                     ("target" if sup < dem else ("drafter" if dem < sup else "both")),
                     "target_util": rate / sup if sup else 1.0, "drafter_util": rate / dem if dem else 1.0,
                     "samples_per_s_low": r["samples_per_s_min"], "samples_per_s_high": r["samples_per_s_max"]})
    fastest = max(rows, key=lambda x: (x["samples_per_s"], -x["targets"]))
    best = min((x for x in rows if x["samples_per_s"] >= fastest["samples_per_s_low"]), key=lambda x: x["targets"])
    return {"world_size": world, "rows": rows, "best": best, "target_ranks": best["targets"],
            "drafter_ranks": best["drafters"], "predicted_samples_per_s": best["samples_per_s"],
            "bottleneck": best["bottleneck"], "fastest_targets": fastest["targets"],
            "near_tie": best["targets"] < fastest["targets"], "rehearsals": runs, "measured": True}
