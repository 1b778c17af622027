#!/usr/bin/env python3
"""The phase timeline of a traced training step (a Chrome trace written with ``logging.debug.profile_step=N`` or
``bench/pipeline.py --profile-step N``): per phase (each anchor group's forward, its loss or head request, the
each group's backward, optimizer) its start, its span, its kernels' busy time and the GPU's idle
time inside it; the NCCL kernels' totals.

    python bench/profile_timeline.py runs/x/profile/drafter_rank0_step30.json [--json out.json]
    python bench/profile_timeline.py docs/results/2026-11-30-h200x2/m2_profile_call32.json.gz
    python bench/profile_timeline.py A.json.gz B.json.gz --png phases.png      # one bar per trace, by phase
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash_dist.telemetry.step_trace import format_timeline, load_trace, timeline  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", help="Chrome trace JSON files (.json or .json.gz)")
    p.add_argument("--json", default=None, help="also write the timelines here")
    p.add_argument("--png", default=None, help="also plot them: one bar per trace, its phases in order")
    p.add_argument("--labels", default=None, help="comma list of bar labels (default: the file names)")
    args = p.parse_args(argv)
    out = {}
    for path in args.traces:
        tl = timeline(load_trace(path))
        if not tl["phases"]:
            print(f"{path}: no dflash/ phases in this trace", file=sys.stderr)
            return 1
        print(format_timeline(tl, os.path.basename(path)) + "\n")
        out[path] = tl
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.png:
        labels = args.labels.split(",") if args.labels else [os.path.basename(x) for x in out]
        plot(list(out.values()), labels, args.png)
    return 0


KINDS = {"forward": "tab:blue", "loss": "tab:red", "head request": "tab:orange", "head replies": "black",
         "backward": "tab:green",
         "clip and optimizer": "tab:gray"}


def kind(name: str) -> str:
    """The phase's kind (its name without the group): 'group1 backward' -> 'backward'."""
    return next((k for k in KINDS if name.endswith(k)), "other")


def plot(timelines: list, labels: list, path: str) -> None:
    """Horizontal bars, one per timeline: its phases left to right, coloured by kind, each phase's idle time
    hatched (at the phase's end: the trace says how much, the bar does not say where)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 1.4 + 0.8 * len(timelines)))
    seen = set()
    for y, (tl, label) in enumerate(zip(timelines, labels)):
        for p in tl["phases"]:
            k = kind(p["name"])
            ax.barh(y, p["ms"], left=p["start_ms"], color=KINDS.get(k, "tab:purple"), edgecolor="white",
                    label=None if k in seen else k)
            seen.add(k)
            if p.get("idle_ms"):
                ax.barh(y, p["idle_ms"], left=p["start_ms"] + p["ms"] - p["idle_ms"], color="none",
                        hatch="///", edgecolor="black", linewidth=0)
            if p["ms"] > 15:
                ax.text(p["start_ms"] + p["ms"] / 2, y, p["name"].replace("group", "g"), ha="center",
                        va="center", fontsize=7, color="white")
        ax.text(tl["step_ms"] + 2, y, f"{tl['step_ms']:.0f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_xlabel(f"ms from the step's first kernel ({timelines[0]['clock']} clock; hatched: the phase's idle "
                  "time, drawn at its end)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=7, ncol=6)
    ax.set_title("one traced drafter step, phase by phase")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
