#!/usr/bin/env python3
"""Settings compared by the acceptance they train: one real job per setting (1 target + 2 drafters on CPU, the same
plan, samples and held-out prompts in every run), each ending with the in-training evaluation on every held-out
prompt; the table lists tau (mean over prompts, with its standard error), pooled tau, the steps, the last logged
window's statistics, and each setting's tau minus the first's over the same prompts (paired: the prompts' own spread
cancels).

    # objectives on the tiny default
    python bench/tau_compare.py --out-dir /tmp/obj --run 'decay=' --run 'dpace=drafter.loss.weighting=dpace' \\
        --run 'kl=drafter.loss.kind=kl'
    # labels from the target on the unregenerated corpus
    python bench/tau_compare.py --out-dir /tmp/labels --set data.source=builtin_original \\
        --run 'data=' --run 'target=drafter.loss.labels=target'
    # DFlash2's selector gold on a larger run
    python bench/tau_compare.py --out-dir /tmp/gold --epochs 5 --holdout 128 --set drafter=tiny_dflash2 \\
        --run 'exclude=drafter.dflash2.selector_gold=exclude' --run 'replace_last=drafter.dflash2.selector_gold=replace_last'

``--run 'NAME=OVERRIDE OVERRIDE ...'`` (repeatable, in order; overrides split as a shell would), ``--set KEY=VALUE``
for every run (repeatable).
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

import _common as C

# statistics of the last full logging window shown when the runs log them (DFlash2's selector, D-PACE's weights,
# the accuracy of what a variant serves)
WINDOW_KEYS = ("loss", "acc", "served_acc", "acc_unary", "acc_selected", "gold_in_topk", "tau_selector", "selector_ce",
               "mean_row_weight")


def job_command(run_dir: str, overrides: list[str], args) -> list[str]:
    """The torchrun command of one run, evaluated only at the end, on all its held-out prompts."""
    base = [f"train.epochs={args.epochs}", f"data.holdout={args.holdout}", f"train.eval_prompts={args.holdout}",
            "train.eval_every=0", f"train.output_dir={run_dir}",
            f"data.cache_dir={os.path.join(args.out_dir, 'data_cache')}", "logging.wandb.mode=disabled",
            "logging.progress_bar=false"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
            "-m", "dflash_dist.train"] + base + list(args.set) + overrides


def summarize(run_dir: str) -> dict:
    """The final evaluation and the last full logging window of a finished run (metrics.jsonl)."""
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    if not train or not evals:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no train or eval record: did the job finish?")
    # the last full window (the final record may cover the epoch's last short step alone)
    gaps = [b["step"] - a["step"] for a, b in zip(train, train[1:])]
    full = [b for a, b in zip(train, train[1:]) if b["step"] - a["step"] == statistics.mode(gaps)] if gaps else train
    last, ev = full[-1], evals[-1]
    return {"per_prompt_tau": [sum(x) / len(x) for x in ev["acceptance_lengths"]], "steps": train[-1]["step"],
            "tau": ev["tau"], "tau_stderr": ev.get("tau_stderr"), "tau_pooled": ev["tau_pooled"],
            "n_prompts": ev["n_prompts"], "window": {k: last[k] for k in WINDOW_KEYS if k in last}}


def paired(first: dict, other: dict) -> dict | None:
    """Mean over the same prompts of other's tau minus first's, and its standard error."""
    d = [y - x for x, y in zip(first["per_prompt_tau"], other["per_prompt_tau"])]
    if len(d) != len(first["per_prompt_tau"]) or len(d) < 2:
        return None
    return {"mean": statistics.fmean(d), "stderr": statistics.stdev(d) / len(d) ** 0.5, "n_prompts": len(d)}


def table(results: dict) -> str:
    lines = ["| setting | steps | tau (± stderr) | pooled tau | tau - first's (paired) | last window | wall s |",
             "| --- | ---: | --- | ---: | --- | --- | ---: |"]
    for name, r in results.items():
        d = r.get("paired")
        diff = "" if d is None else f"{d['mean']:+.3f} ± {d['stderr']:.3f}"
        window = ", ".join(f"{k} {v:.3f}" for k, v in r["window"].items())
        lines.append(f"| `{name}` | {r['steps']} | {r['tau']:.3f} ± {r['tau_stderr'] or 0:.3f} | "
                     f"{r['tau_pooled']:.3f} | {diff} | {window} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def parse_runs(specs: list[str]) -> dict[str, list[str]]:
    runs = {}
    for spec in specs:
        name, sep, rest = spec.partition("=")
        if not sep or not name or name in runs:
            raise SystemExit(f"--run {spec!r}: expected a new NAME=OVERRIDES (overrides may be empty: 'NAME=')")
        runs[name] = shlex.split(rest)
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True, help="one run directory per setting, the data cache and result.json")
    p.add_argument("--run", action="append", required=True, help="NAME=OVERRIDES of one setting (repeatable)")
    p.add_argument("--set", action="append", default=[], help="an override KEY=VALUE of every run (repeatable)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--holdout", type=int, default=16, help="held-out prompts, all of them evaluated at the end")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--summarize-only", action="store_true", help="read the finished runs in --out-dir, run nothing")
    args = p.parse_args(argv)
    runs = parse_runs(args.run)
    os.makedirs(args.out_dir, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=C.REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    results = {}
    for name, overrides in runs.items():
        run_dir = os.path.join(args.out_dir, name)
        cmd = job_command(run_dir, overrides, args)
        t0 = time.time()
        if not args.summarize_only:
            print(" ".join(cmd[2:]), flush=True)
            with open(os.path.join(args.out_dir, f"{name}.log"), "w") as log:
                rc = subprocess.run(cmd, cwd=C.REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=args.timeout).returncode
            if rc != 0:
                raise SystemExit(f"the {name} run failed (exit {rc}): see {args.out_dir}/{name}.log")
        results[name] = {**summarize(run_dir), "wall_s": time.time() - t0, "command": " ".join(cmd[2:])}
        first = next(iter(results.values()))
        if results[name] is not first:
            results[name]["paired"] = paired(first, results[name])
        print(json.dumps({k: v for k, v in results[name].items() if k != "per_prompt_tau"}), flush=True)
    with open(os.path.join(args.out_dir, "result.json"), "w") as f:
        json.dump({"env": {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count()}, "results": results},
                  f, indent=1)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
