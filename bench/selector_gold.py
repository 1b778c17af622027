#!/usr/bin/env python3
"""DFlash2's selector gold setting (``drafter.dflash2.selector_gold``) measured by the real job: one torchrun job
per setting (1 target + 2 drafters on CPU, the same plan, samples and held-out prompts in every run), each
ending with the in-training evaluation; the table lists tau (mean over prompts, with its standard error), pooled
tau, the steps and the selector's last logged statistics.

    python bench/selector_gold.py --out-dir /tmp/gold                       # the tiny default, both settings
    python bench/selector_gold.py --out-dir /tmp/gold_large --epochs 6 --holdout 128 \\
        --set drafter.dflash2.selector_top_k=16      # any further job override (repeatable)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import _common as C

SETTINGS = ("exclude", "replace_last")


def job_command(gold: str, run_dir: str, args) -> list[str]:
    """The torchrun command of one run: ``drafter=<preset>`` with ``selector_gold=<gold>``, evaluated only at the end."""
    overrides = [f"drafter={args.drafter}", f"drafter.dflash2.selector_gold={gold}", f"train.epochs={args.epochs}",
                 f"data.holdout={args.holdout}", f"train.eval_prompts={args.holdout}", "train.eval_every=0",
                 f"train.output_dir={run_dir}", f"data.cache_dir={os.path.join(args.out_dir, 'data_cache')}",
                 "logging.wandb.mode=disabled", "logging.progress_bar=false",
                 # the other drafter waits in the closing all-reduce while the leader waits for the final
                 # evaluation: many prompts on a busy CPU outlast the short 60 s limit
                 "topology.timeout_s=1800"] + list(args.set)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
            "-m", "dflash_dist.train"] + overrides


def summarize(run_dir: str) -> dict:
    """The final evaluation and the last logged training statistics of a finished run (metrics.jsonl)."""
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    if not train or not evals:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no train or eval record: did the job finish?")
    # the last full logging window (the final record may cover the epoch's last short step alone)
    gaps = [b["step"] - a["step"] for a, b in zip(train, train[1:])]
    full = [b for a, b in zip(train, train[1:]) if b["step"] - a["step"] == statistics.mode(gaps)] if gaps else train
    last, ev = full[-1], evals[-1]
    keep = ("acc_unary", "acc_selected", "gold_in_topk", "tau_selector", "selector_ce")
    per_prompt = [sum(x) / len(x) for x in ev["acceptance_lengths"]]  # each prompt's mean acceptance length
    return {"per_prompt_tau": per_prompt, "steps": train[-1]["step"], "window_step": last["step"], "tau": ev["tau"], "tau_stderr": ev.get("tau_stderr"),
            "tau_pooled": ev["tau_pooled"], "n_prompts": ev["n_prompts"],
            "first_selector_ce": train[0].get("selector_ce"), **{k: last.get(k) for k in keep}}


def _wall(run_dir: str) -> float:
    """A finished run's seconds from its run.json creation to its last metrics record."""
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    created = time.mktime(time.strptime(json.load(open(os.path.join(run_dir, "run.json")))["created"],
                                        "%Y-%m-%d %H:%M:%S"))
    return max(r["time"] for r in rows if "time" in r) - created


def paired(results: dict) -> dict | None:
    """Two settings evaluated on the same prompts: the mean over prompts of their tau difference (second minus
    first) and its standard error (the prompts' own spread cancels)."""
    if len(results) != 2:
        return None
    (na, a), (nb, b) = results.items()
    d = [y - x for x, y in zip(a["per_prompt_tau"], b["per_prompt_tau"])]
    if len(d) != len(a["per_prompt_tau"]) or len(d) < 2:
        return None
    return {"difference": f"{nb} - {na}", "mean": statistics.fmean(d),
            "stderr": statistics.stdev(d) / len(d) ** 0.5, "n_prompts": len(d)}


def table(results: dict) -> str:
    head = ("| `selector_gold` | steps | tau (mean over prompts, ± stderr) | pooled tau | acc_unary / acc_selected "
            "(last window) | gold_in_topk | tau_selector (teacher forced) | selector_ce first -> last | wall s |")
    lines = [head, "| --- | ---: | --- | ---: | --- | ---: | ---: | --- | ---: |"]
    for gold, r in results.items():
        lines.append(f"| `{gold}` | {r['steps']} | {r['tau']:.2f} ± {r['tau_stderr'] or 0:.2f} | {r['tau_pooled']:.2f} "
                     f"| {r['acc_unary']:.2f} / {r['acc_selected']:.2f} | {r['gold_in_topk']:.2f} "
                     f"| {r['tau_selector']:.2f} | {r['first_selector_ce']:.2f} -> {r['selector_ce']:.2f} "
                     f"| {r['wall_s']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True, help="one run directory per setting, the data cache and result.json")
    p.add_argument("--gold", default=",".join(SETTINGS), help="comma-separated settings to run, in this order")
    p.add_argument("--drafter", default="tiny_dflash2", help="the drafter preset (a DFlash2 one)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--holdout", type=int, default=16, help="held-out prompts, all of them evaluated at the end")
    p.add_argument("--set", action="append", default=[], help="a further job override KEY=VALUE (repeatable)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--summarize-only", action="store_true", help="read the finished runs in --out-dir, run nothing")
    args = p.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=C.REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    results = {}
    for gold in args.gold.split(","):
        run_dir = os.path.join(args.out_dir, gold)
        cmd = job_command(gold, run_dir, args)
        t0 = time.time()
        if not args.summarize_only:
            print(" ".join(cmd[2:]), flush=True)
            with open(os.path.join(args.out_dir, f"{gold}.log"), "w") as log:
                rc = subprocess.run(cmd, cwd=C.REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=args.timeout).returncode
            if rc != 0:
                raise SystemExit(f"the {gold} run failed (exit {rc}): see {args.out_dir}/{gold}.log")
        wall = time.time() - t0 if not args.summarize_only else _wall(run_dir)
        results[gold] = {**summarize(run_dir), "wall_s": wall, "command": " ".join(cmd[2:])}
        print(json.dumps({k: v for k, v in results[gold].items() if k != "per_prompt_tau"}), flush=True)
    diff = paired(results)
    with open(os.path.join(args.out_dir, "result.json"), "w") as f:
        json.dump({"env": {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count()},
                   "results": results, "paired": diff}, f, indent=1)
    print(table(results))
    if diff:
        print(f"paired over the same {diff['n_prompts']} prompts: tau {diff['difference']} = {diff['mean']:+.3f} "
              f"± {diff['stderr']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
