"""A real ``dflash-train`` job on one GPU (colocated: the target and the drafter on one device), next to its two parts
timed alone on the same device by ``dflash-plan``, and what the plan predicts for colocated and the T + D splits.

For each ``--case LABEL:OVERRIDES`` (overrides separated by spaces, on top of the common ones):
1. ``dflash-plan --gpus 1,2,4,8`` with the job's overrides: target capture (supply) and the drafter step (demand), each
   timed alone, and every split's predicted samples/s;
2. the job, ``dflash-train`` with one process, started from that plan (``topology.target_ranks=auto
   topology.plan=...``): its own metrics give samples/s per window, and it logs "planned X, measured Y".
Then one table: the parts' bound 1 / (1/supply + 1/demand), the job's steady samples/s (median window after the
warm-up steps), their ratio, and the plan's per-GPU predictions for 1+1, 1+3, 2+6 and the best 8-GPU split.

    python bench/colocated_job.py --out /tmp/colo --steps 60 \\
        --case "dflash16:drafter=dflash drafter.num_anchors=256"

Common overrides: the Qwen3-8B-shaped random target, synthetic ~550-token samples (275..825), 4 samples per
message (target.max_batch_tokens=4096, max_batch_samples=4), wandb off.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def common(target: str, mean_len: int, samples: int) -> list[str]:
    return [f"target={target}", f"data.source=synthetic:{mean_len}:{samples}", "target.max_batch_tokens=4096",
            "target.max_batch_samples=4", "logging.wandb.mode=disabled", "logging.progress_bar=false",
            "train.eval_prompts=0"]


def cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def run(cmd: list[str], log_path: str, timeout: float) -> tuple[int, float]:
    t0 = time.monotonic()
    with open(log_path, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.monotonic() - t0


def steady_rate(metrics_path: str, after_step: int) -> dict:
    recs = [json.loads(x) for x in open(metrics_path) if x.strip()]
    wins = [r for r in recs if r.get("kind") == "train" and r["step"] > after_step and r.get("samples_per_s")]
    rates = [r["samples_per_s"] for r in wins]
    check = next((r for r in recs if r.get("kind") == "plan_check"), None)
    out = {"windows": len(rates), "samples_per_s": statistics.median(rates) if rates else None,
           "window_rates": [round(x, 3) for x in rates], "plan_check": check}
    if wins:  # the two roles' shares of the colocated rank's time (the drafter waits while its target half captures)
        out["drafter_wait_frac"] = statistics.median(r.get("drafter_wait_frac", 0.0) for r in wins)
        out["drafter_mfu"] = statistics.median(r.get("drafter_mfu", 0.0) or 0.0 for r in wins)
    return out


def per_gpu(plan: dict, world: int, targets: int):
    for s in plan["splits"]:
        if s["world_size"] == world:
            for r in s["rows"]:
                if r["targets"] == targets:
                    return r["per_gpu"]
    return None


def one_case(label: str, extra: list[str], args) -> dict:
    ov = common(args.target, args.mean_len, args.samples) + extra
    plan_json = os.path.join(args.out, f"plan-{label}.json")
    res = {"label": label, "overrides": ov}
    env_py = [sys.executable, "-m"]
    alone = [] if cuda() else ["--alone"]  # CPU: each part timed alone here too (not rehearsed as jobs)
    rc, secs = run(env_py + ["dflash_dist.cli.plan", "--gpus", "1,2,4,8", "--out", plan_json] + alone + ov,
                   os.path.join(args.out, f"plan-{label}.log"), args.plan_timeout)
    res.update(plan_rc=rc, plan_s=round(secs, 1))
    if rc != 0:
        return res
    plan = json.load(open(plan_json))
    s, d = plan["supply"]["samples_per_s"], plan["demand"]["samples_per_s"]
    res.update(supply=s, demand=d, parts_bound=1 / (1 / s + 1 / d),
               plan_1_1=per_gpu(plan, 2, 1), plan_1_3=per_gpu(plan, 4, 1), plan_2_6=per_gpu(plan, 8, 2),
               plan_8_best=next(b for b in plan["best"] if b["world_size"] == 8))
    run_dir = os.path.join(args.work, label)
    job = env_py + ["dflash_dist.cli.train", "--nproc-per-node", "1"] + ov + [
        f"train.output_dir={run_dir}", f"train.max_steps={args.steps}", f"logging.log_every={args.log_every}",
        "topology.target_ranks=auto", f"topology.plan={plan_json}", "train.checkpoint_every=0"]
    rc, secs = run(job, os.path.join(args.out, f"job-{label}.log"), args.job_timeout)
    res.update(job_rc=rc, job_s=round(secs, 1), job_command="dflash-train " + " ".join(shlex.quote(x) for x in job[3:]))
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        res["job"] = steady_rate(os.path.join(run_dir, "metrics.jsonl"), args.warmup_steps)
        m = res["job"]["samples_per_s"]
        if m:
            res["job_over_parts"] = m / res["parts_bound"]
    for name in ("startup_report.json",):
        p = os.path.join(run_dir, name)
        if os.path.exists(p):
            res["startup_report"] = json.load(open(p))
    return res


def table(rows: list[dict]) -> str:
    head = ("| case | capture alone (samples/s) | step alone (samples/s) | bound 1/(t_c+t_s) | job samples/s (median window) "
            "| job / bound | plan colocated | plan 1+1 /GPU | 1+3 /GPU | 2+6 /GPU | 8-GPU best /GPU |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(x, p=2):
        return "-" if x is None else f"{x:.{p}f}"
    for r in rows:
        job = (r.get("job") or {}).get("samples_per_s")
        best = r.get("plan_8_best") or {}
        lines.append(f"| {r['label']} | {f(r.get('supply'))} | {f(r.get('demand'))} | {f(r.get('parts_bound'))} | "
                     f"{f(job)} | {f(r.get('job_over_parts'), 3)} | {f(r.get('parts_bound'))} | {f(r.get('plan_1_1'))} | "
                     f"{f(r.get('plan_1_3'))} | {f(r.get('plan_2_6'))} | "
                     f"{f(best.get('per_gpu'))} ({best.get('target_ranks', '-')}T) |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/colocated_job"))
    ap.add_argument("--work", default="/tmp/colocated_job_work", help="run directories (not copied to --out)")
    ap.add_argument("--case", action="append", required=True, help="LABEL:OVERRIDES (space separated)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--warmup-steps", type=int, default=20, help="windows up to this step are left out")
    ap.add_argument("--target", default="qwen3_8b_random", help="target preset (tiny: a CPU smoke run)")
    ap.add_argument("--mean-len", type=int, default=550)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--plan-timeout", type=float, default=240)
    ap.add_argument("--job-timeout", type=float, default=300)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for case in args.case:
        label, _, ov = case.partition(":")
        rows.append(one_case(label, ov.split(), args))
        with open(os.path.join(args.out, "colocated_job.json"), "w") as f:
            json.dump({"rows": rows}, f, indent=1, default=str)
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("startup_report", "overrides")},
                         default=str), flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
