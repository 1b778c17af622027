"""``dflash-report RUN_DIR``: the throughput dashboard without wandb, as PNG plots of the run's metrics.jsonl.

    dflash-report outputs/default [--out outputs/default/report]

Writes (each only when the run logged what it needs):

- ``loss.png``: training loss (and the learning rate) per step;
- ``samples_per_s.png``: the job's samples/s, each drafter's, each target rank's, per step;
- ``supply_demand.png``: what the targets could send (each target's samples/s over its busy fraction, summed)
  against what the drafters could take (the job's samples/s over the drafters' busy fraction), and what the
  job did: the lower capacity is the bottleneck;
- ``acceptance_per_position.png``: measured acceptance per block position of each in-training evaluation, and
  the training accuracy per slot of the last training window;
- ``tau.png``: tau per evaluation, both ways (z-lab's mean over prompts, and pooled over verify steps), with the
  tau the training accuracy predicts.

Needs matplotlib (``pip install 'dflash_dist[report]'``). Prints the written paths and the peak and mean samples/s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Optional

from dflash_dist.telemetry.metrics import capacity_metrics, position_values

_TARGET_SPS = re.compile(r"target(\d+)_samples_per_s")


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl (unreadable lines skipped: a run killed mid-write leaves half a line)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "step" in rec:
                out.append(rec)
    return out


def _series(recs: list, key: str) -> tuple[list, list]:
    xs, ys = [], []
    for r in recs:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def write_report(run_dir: str, out_dir: Optional[str] = None) -> dict:
    """Write the PNGs of ``run_dir``'s metrics.jsonl into ``out_dir`` (default ``run_dir/report``).
    Returns {"files": [...], "samples_per_s_peak": ..., "samples_per_s_mean": ...}."""
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("dflash-report needs matplotlib: pip install 'dflash_dist[report]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no metrics.jsonl in {run_dir} (is it a training output_dir?)")
    recs = read_metrics(path)
    train = [r for r in recs if r.get("kind", "train") == "train"]
    evals = [r for r in recs if r.get("kind") == "eval"]
    out_dir = out_dir or os.path.join(run_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    files = []

    def save(fig, name):
        p = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        files.append(p)

    xs, ys = _series(train, "loss")
    if xs:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(xs, ys, label="loss", color="tab:blue")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        lx, ly = _series(train, "lr")
        if lx:
            ax2 = ax.twinx()
            ax2.plot(lx, ly, color="tab:gray", linestyle=":", label="lr")
            ax2.set_ylabel("learning rate")
        ax.set_title("training loss")
        ax.grid(alpha=0.3)
        save(fig, "loss.png")

    xs, ys = _series(train, "samples_per_s")
    if xs:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(xs, ys, label="job", linewidth=2)
        dx, dy = _series(train, "drafter_samples_per_s")
        if dx:
            ax.plot(dx, dy, label="each drafter")
        targets = sorted({int(m.group(1)) for r in train for k in r for m in [_TARGET_SPS.fullmatch(k)] if m})
        for t in targets:
            tx, ty = _series(train, f"target{t}_samples_per_s")
            ax.plot(tx, ty, label=f"target rank {t}", alpha=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("samples/s")
        ax.set_title("samples/s per role")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, "samples_per_s.png")

        caps = [{**r, **capacity_metrics(r)} for r in train]
        sx, sy = _series(caps, "target_capacity_samples_per_s")
        dx, dy = _series(caps, "drafter_capacity_samples_per_s")
        if sx or dx:
            fig, ax = plt.subplots(figsize=(7, 4))
            if sx:
                ax.plot(sx, sy, label="supply: targets' capacity (samples/s / busy)")
            if dx:
                ax.plot(dx, dy, label="demand: drafters' capacity (samples/s / busy)")
            ax.plot(xs, ys, label="job samples/s", color="black", linewidth=2)
            ax.set_xlabel("step")
            ax.set_ylabel("samples/s")
            ax.set_title("supply vs demand (the lower capacity bounds the job)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            save(fig, "supply_demand.png")

    last_train_pos = position_values("train", train[-1]) if train else []
    eval_pos = [(r["step"], position_values("eval", r)) for r in evals]
    eval_pos = [(s, p) for s, p in eval_pos if p]
    if last_train_pos or eval_pos:
        fig, ax = plt.subplots(figsize=(7, 4))
        for s, p in eval_pos:
            ax.plot([k for k, _ in p], [v for _, v in p], marker="o", label=f"measured, step {s}")
        if last_train_pos:
            ax.plot([k for k, _ in last_train_pos], [v for _, v in last_train_pos], linestyle="--", color="gray",
                    label=f"training accuracy, step {train[-1]['step']}")
        ax.set_xlabel("block position")
        ax.set_ylabel("acceptance")
        ax.set_ylim(0, 1)
        ax.set_title("acceptance per block position")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, "acceptance_per_position.png")

    tx, ty = _series(evals, "tau")
    if tx:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(tx, ty, marker="o", label="tau (z-lab: mean over prompts)")
        px, py = _series(evals, "tau_pooled")
        if px:
            ax.plot(px, py, marker="s", label="tau pooled (tokens / verify steps)")
        fx, fy = _series(evals, "tau_from_train_acc")
        if fx:
            ax.plot(fx, fy, linestyle=":", label="tau predicted by training accuracy")
        ax.set_xlabel("step")
        ax.set_ylabel("acceptance length")
        ax.set_title("acceptance length")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, "tau.png")

    _, sps = _series(train, "samples_per_s")
    return {"files": files, "samples_per_s_peak": max(sps) if sps else None,
            "samples_per_s_mean": sum(sps) / len(sps) if sps else None}


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="dflash-report", description="PNG plots of a training run's metrics.jsonl "
                                "(loss, samples/s per role, supply vs demand, acceptance per position, tau).")
    p.add_argument("run_dir", help="a training output_dir (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="where to write the PNGs (default: RUN_DIR/report)")
    args = p.parse_args(argv)
    try:
        res = write_report(args.run_dir, args.out)
    except FileNotFoundError as e:
        print(f"dflash-report: {e}", file=sys.stderr)
        return 2
    for f in res["files"]:
        print(f"wrote {f}")
    if res["samples_per_s_peak"] is not None:
        print(f"samples/s: peak {res['samples_per_s_peak']:.2f}, mean {res['samples_per_s_mean']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
