#!/usr/bin/env python3
"""Plot the step-time breakdown that ``drafter_step.py --profile CTXxANCHORS`` recorded (GPU ms by kernel category).

    python bench/plot_breakdown.py drafter_step.json --png breakdown.png
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json")
    p.add_argument("--png", required=True)
    args = p.parse_args(argv)
    with open(args.json) as f:
        d = json.load(f)
    rows = [r for r in d["rows"] if r.get("breakdown_ms")]
    if not rows:
        print(f"{args.json}: no row has a breakdown (run drafter_step.py with --profile)", file=sys.stderr)
        return 1
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.9 * len(rows)))
    for y, r in enumerate(rows):
        bd = {k: v for k, v in r["breakdown_ms"].items() if k not in ("total", "top_kernels")}
        left = 0.0
        for cat, ms in sorted(bd.items(), key=lambda kv: -kv[1]):
            ax.barh(y, ms, left=left, label=cat if y == 0 else None)
            if ms > 6:
                ax.text(left + ms / 2, y, f"{ms:.0f}", ha="center", va="center", fontsize=8)
            left += ms
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r['backend']} {r['ctx']}/{r['anchors']}\n{r['ms_per_step']:.0f} ms wall" for r in rows])
    ax.set_xlabel("GPU time of one step (ms)")
    ax.set_title("drafter step time by kernel category (" + d["env"].get("gpu", "?") + ")")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
