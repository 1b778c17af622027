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
- ``tau.png``: the acceptance length per evaluation (pooled over verify steps: the headline, drawn first), z-lab's
  tau (mean over prompts) beside it, and the tau the training accuracy predicts.

Needs matplotlib (``pip install 'dflash_dist[report]'``). Prints the written paths and the peak and mean samples/s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Optional

from dflash_dist.checkpoint.safe_io import MAX_LOG_BYTES, CheckpointError, regular_file
from dflash_dist.telemetry.metrics import capacity_metrics, position_values

_TARGET_SPS = re.compile(r"target(\d+)_samples_per_s")


def read_metrics(path: str) -> tuple[list[dict], dict]:
    """(records, {"lines": skipped lines, "values": values left out}) of a metrics.jsonl. A line that is not
    UTF-8, not JSON or not a record with an integer ``step`` is skipped (a run killed mid-write leaves half a
    line); a value that is not a number (``kind`` aside) is left out of its record, so no figure meets it."""
    out, bad = [], {"lines": 0, "values": 0}
    with open(path, "rb") as f:
        for raw in f:
            try:
                rec = json.loads(raw.decode("utf-8"))
            except (ValueError, RecursionError):   # UnicodeDecodeError is a ValueError
                bad["lines"] += 1
                continue
            if not (isinstance(rec, dict) and _is_number(rec.get("step")) and isinstance(rec["step"], int)
                    and isinstance(rec.get("kind", "train"), str)):
                bad["lines"] += 1
                continue
            kept = {k: v for k, v in rec.items() if k == "kind" or _is_number(v)}
            bad["values"] += len(rec) - len(kept)
            out.append(kept)
    return out, bad


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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
    Returns {"files": [...], "samples_per_s_peak": ..., "samples_per_s_mean": ..., "skipped": {"lines": ...,
    "values": ...}} (what :func:`read_metrics` could not use)."""
    plt = _pyplot()
    train, evals, bad = _load_run(run_dir)
    out_dir = out_dir or os.path.join(run_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    files = []
    figures = (("loss.png", _loss_figure, (train,)), ("samples_per_s.png", _samples_per_s_figure, (train,)),
               ("supply_demand.png", _supply_demand_figure, (train,)),
               ("acceptance_per_position.png", _acceptance_figure, (train, evals)), ("tau.png", _tau_figure, (evals,)))
    for name, draw, recs in figures:
        fig = draw(plt, *recs)  # None: the run did not log what this figure needs
        if fig is not None:
            files.append(_save(plt, fig, os.path.join(out_dir, name)))
    _, sps = _series(train, "samples_per_s")
    return {"files": files, "samples_per_s_peak": max(sps) if sps else None,
            "samples_per_s_mean": sum(sps) / len(sps) if sps else None, "skipped": bad}


def _pyplot():
    """matplotlib.pyplot on the Agg backend (files only: no display is needed)."""
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("dflash-report needs matplotlib: pip install 'dflash_dist[report]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _load_run(run_dir: str) -> tuple[list, list, dict]:
    """(training records, evaluation records, what was skipped) of ``run_dir``'s metrics.jsonl."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no metrics.jsonl in {run_dir} (is it a training output_dir?)")
    regular_file(run_dir, path, MAX_LOG_BYTES)   # a FIFO would block the read
    recs, bad = read_metrics(path)
    return [r for r in recs if r.get("kind", "train") == "train"], [r for r in recs if r.get("kind") == "eval"], bad


def _save(plt, fig, path: str) -> str:
    """Write ``fig`` to ``path`` and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _finish(ax, xlabel: str, ylabel: str, title: str, legend: bool = True) -> None:
    """The labels, title, grid and legend every figure has."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=8)


def _plot(ax, recs: list, key: str, **style) -> None:
    """``key`` per step on ``ax``, when the run logged it."""
    xs, ys = _series(recs, key)
    if xs:
        ax.plot(xs, ys, **style)


def _loss_figure(plt, train: list):
    """Training loss per step, the learning rate on a second axis."""
    if not _series(train, "loss")[0]:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    _plot(ax, train, "loss", label="loss", color="tab:blue")
    lx, ly = _series(train, "lr")
    if lx:
        ax2 = ax.twinx()
        ax2.plot(lx, ly, color="tab:gray", linestyle=":", label="lr")
        ax2.set_ylabel("learning rate")
    _finish(ax, "step", "training loss", "training loss", legend=False)
    return fig


def _samples_per_s_figure(plt, train: list):
    """The job's samples/s, each drafter's and each target rank's."""
    if not _series(train, "samples_per_s")[0]:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    _plot(ax, train, "samples_per_s", label="job", linewidth=2)
    _plot(ax, train, "drafter_samples_per_s", label="each drafter")
    targets = sorted({int(m.group(1)) for r in train for k in r for m in [_TARGET_SPS.fullmatch(k)] if m})
    for t in targets:
        _plot(ax, train, f"target{t}_samples_per_s", label=f"target rank {t}", alpha=0.8)
    _finish(ax, "step", "samples/s", "samples/s per role")
    return fig


def _supply_demand_figure(plt, train: list):
    """What the targets could send and the drafters could take, against what the job did."""
    caps = [{**r, **capacity_metrics(r)} for r in train]
    keys = ("target_capacity_samples_per_s", "drafter_capacity_samples_per_s")
    # the capacities are read against what the job did: no figure without the job's samples/s
    if not _series(train, "samples_per_s")[0] or not any(_series(caps, k)[0] for k in keys):
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    _plot(ax, caps, "target_capacity_samples_per_s", label="supply: targets' capacity (samples/s / busy)")
    _plot(ax, caps, "drafter_capacity_samples_per_s", label="demand: drafters' capacity (samples/s / busy)")
    _plot(ax, train, "samples_per_s", label="job samples/s", color="black", linewidth=2)
    _finish(ax, "step", "samples/s", "supply vs demand (the lower capacity bounds the job)")
    return fig


def _acceptance_figure(plt, train: list, evals: list):
    """Measured acceptance per block position of each evaluation, and the last window's training accuracy."""
    last_train_pos = position_values("train", train[-1]) if train else []
    eval_pos = [(r["step"], position_values("eval", r)) for r in evals]
    eval_pos = [(s, p) for s, p in eval_pos if p]
    if not (last_train_pos or eval_pos):
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for s, p in eval_pos:
        ax.plot([k for k, _ in p], [v for _, v in p], marker="o", label=f"measured, step {s}")
    if last_train_pos:
        ax.plot([k for k, _ in last_train_pos], [v for _, v in last_train_pos], linestyle="--", color="gray",
                label=f"training accuracy, step {train[-1]['step']}")
    ax.set_ylim(0, 1)
    _finish(ax, "block position", "acceptance", "acceptance per block position")
    return fig


def _tau_figure(plt, evals: list):
    """The pooled acceptance length per evaluation first, z-lab's tau beside it, and the tau the training accuracy
    predicts. Runs before the pooled figure had its own key carry it as ``tau_pooled``."""
    pooled = "acceptance_length" if _series(evals, "acceptance_length")[0] else "tau_pooled"
    if not _series(evals, pooled)[0] and not _series(evals, "tau")[0]:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    _plot(ax, evals, pooled, marker="s", linewidth=2.5, label="acceptance length (pooled: tokens / verify steps)")
    _plot(ax, evals, "tau", marker="o", label="tau (z-lab: mean over prompts)")
    _plot(ax, evals, "tau_from_train_acc", linestyle=":", label="tau predicted by training accuracy")
    _finish(ax, "step", "acceptance length", "acceptance length")
    return fig


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
    except CheckpointError as e:
        print(f"dflash-report: {e}", file=sys.stderr)
        return 2
    bad = res["skipped"]
    if bad["lines"] or bad["values"]:
        print(f"dflash-report: skipped {bad['lines']} unreadable lines of metrics.jsonl (not UTF-8, not JSON or no "
              f"integer step) and {bad['values']} values that are not numbers", file=sys.stderr)
    for f in res["files"]:
        print(f"wrote {f}")
    if res["samples_per_s_peak"] is not None:
        print(f"samples/s: peak {res['samples_per_s_peak']:.2f}, mean {res['samples_per_s_mean']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
