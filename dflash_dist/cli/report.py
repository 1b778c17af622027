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
  tau (mean over prompts) beside it, and the tau the training accuracy predicts;
- ``phases.png``: with ``logging.debug.profile_step``, one bar per traced step of ``profile/`` (each rank's Chrome
  trace), its phases in order, each phase's idle time hatched.

Needs matplotlib (``pip install 'dflash_dist[report]'``). Prints the written paths and the peak and mean samples/s,
and from the run's debug output: with ``logging.debug.trace_target``, each target rank's trace
(``target_trace/rank<r>.jsonl``) summarised, per part (stall, capture, backpressure, evaluation) the median and the
largest milliseconds over the messages after the first ``--trace-skip`` (load and compile) and the part's share of
the traced time; with ``logging.debug.profile_step``, each traced step's phase timeline
(``telemetry.step_trace.format_timeline``).
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
from dflash_dist.telemetry.step_trace import format_timeline, load_trace, timeline

_TARGET_SPS = re.compile(r"target(\d+)_samples_per_s")
# the parts of a target trace's line (logging.debug.trace_target), in the order the loop spends them
TRACE_PARTS = ("stall_ms", "capture_ms", "backpressure_ms", "eval_ms")


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


def write_report(run_dir: str, out_dir: Optional[str] = None, trace_skip: int = 10) -> dict:
    """Write the PNGs of ``run_dir``'s metrics.jsonl (and of its traced steps) into ``out_dir`` (default
    ``run_dir/report``). Returns {"files": [...], "samples_per_s_peak": ..., "samples_per_s_mean": ..., "skipped":
    {"lines": ..., "values": ...}} (what :func:`read_metrics` could not use), "target_traces" (each target rank's
    :func:`target_trace_summary`), "timelines" ({trace file name: its phase timeline}) and "unreadable_traces"
    (the traces of ``profile/`` that are not JSON, e.g. one written by a rank killed mid-write)."""
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
    timelines, unreadable = step_timelines(run_dir)
    if timelines:
        files.append(_save(plt, _phases_figure(plt, timelines), os.path.join(out_dir, "phases.png")))
    _, sps = _series(train, "samples_per_s")
    return {"files": files, "samples_per_s_peak": max(sps) if sps else None,
            "samples_per_s_mean": sum(sps) / len(sps) if sps else None, "skipped": bad,
            "target_traces": target_traces(run_dir, trace_skip), "timelines": timelines,
            "unreadable_traces": unreadable}


def _run_files(run_dir: str, sub: str, suffixes: tuple) -> list[str]:
    """The regular files of ``run_dir/sub`` ending in one of ``suffixes``, sorted by name."""
    folder = os.path.join(run_dir, sub)
    if not os.path.isdir(folder):
        return []
    paths = [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.endswith(suffixes)]
    for p in paths:
        regular_file(run_dir, p, MAX_LOG_BYTES)   # a FIFO would block the read
    return paths


def target_trace_summary(rows: list[dict]) -> dict:
    """Per part of a target trace that every row has: {"median", "max"} milliseconds and "share" of the traced
    time (the parts' sum over the rows)."""
    import statistics
    parts = [k for k in TRACE_PARTS if rows and all(_is_number(r.get(k)) for r in rows)]
    total = sum(r[k] for r in rows for k in parts) or 1.0
    return {k: {"median": statistics.median(r[k] for r in rows), "max": max(r[k] for r in rows),
                "share": sum(r[k] for r in rows) / total} for k in parts}


def target_traces(run_dir: str, skip: int) -> dict:
    """{trace file name: {"messages": lines after the first ``skip``, "parts": :func:`target_trace_summary`}} of
    ``run_dir/target_trace/rank<r>.jsonl``. A line that is not a JSON record (a rank killed mid-write) is left out."""
    out = {}
    for path in _run_files(run_dir, "target_trace", (".jsonl",)):
        rows = []
        with open(path, "rb") as f:
            for raw in f:
                try:
                    rec = json.loads(raw.decode("utf-8"))
                except (ValueError, RecursionError):
                    continue
                if isinstance(rec, dict):
                    rows.append(rec)
        rows = rows[skip:]
        out[os.path.basename(path)] = {"messages": len(rows), "parts": target_trace_summary(rows)}
    return out


def step_timelines(run_dir: str) -> tuple[dict, list]:
    """({trace file name: ``step_trace.timeline``} of every Chrome trace in ``run_dir/profile`` with phases, [the
    names of those that could not be read as JSON])."""
    out, unreadable = {}, []
    for path in _run_files(run_dir, "profile", (".json", ".json.gz")):
        try:
            tl = timeline(load_trace(path))
        except (ValueError, EOFError, OSError, KeyError, TypeError, AttributeError):  # gzip.BadGzipFile: an OSError
            unreadable.append(os.path.basename(path))
            continue
        if tl["phases"]:
            out[os.path.basename(path)] = tl
    return out, unreadable


PHASE_KINDS = {"forward": "tab:blue", "loss": "tab:red", "head request": "tab:orange", "head replies": "black",
               "backward": "tab:green", "clip and optimizer": "tab:gray"}


def _phases_figure(plt, timelines: dict):
    """One horizontal bar per traced step: its phases left to right, coloured by kind (the phase's name without
    its group: 'group1 backward' is a backward), each phase's idle time hatched at its end (the trace says how
    much, not where)."""
    fig, ax = plt.subplots(figsize=(11, 1.4 + 0.8 * len(timelines)))
    seen = set()
    for y, tl in enumerate(timelines.values()):
        for p in tl["phases"]:
            kind = next((k for k in PHASE_KINDS if p["name"].endswith(k)), "other")
            ax.barh(y, p["ms"], left=p["start_ms"], color=PHASE_KINDS.get(kind, "tab:purple"), edgecolor="white",
                    label=None if kind in seen else kind)
            seen.add(kind)
            if p.get("idle_ms"):
                ax.barh(y, p["idle_ms"], left=p["start_ms"] + p["ms"] - p["idle_ms"], color="none", hatch="///",
                        edgecolor="black", linewidth=0)
        ax.text(tl["step_ms"], y, f" {tl['step_ms']:.0f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(timelines)))
    ax.set_yticklabels(list(timelines))
    ax.invert_yaxis()
    ax.set_xlabel("ms from the step's start (hatched: the phase's idle time, drawn at its end)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), fontsize=7, ncol=6)
    ax.set_title("traced steps, phase by phase")
    return fig


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
    p.add_argument("--trace-skip", type=int, default=10, help="leave the first N messages (load and compile) out "
                   "of the target trace's summary (default 10)")
    args = p.parse_args(argv)
    try:
        res = write_report(args.run_dir, args.out, args.trace_skip)
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
    for name, t in res["target_traces"].items():
        parts = ", ".join(f"{k} median {v['median']:.1f} max {v['max']:.1f} ({100 * v['share']:.0f}%)"
                          for k, v in t["parts"].items())
        print(f"target trace {name}, {t['messages']} messages after the first {args.trace_skip}: "
              + (parts or "nothing to summarise"))
    for name, tl in res["timelines"].items():
        print(format_timeline(tl, name))
    if res["unreadable_traces"]:
        print(f"dflash-report: unreadable traces in profile/ (not JSON): {', '.join(res['unreadable_traces'])}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
