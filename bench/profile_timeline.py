#!/usr/bin/env python3
"""The phase timeline of a traced training step (a Chrome trace written with ``logging.profile_step=N`` or
``bench/pipeline.py --profile-step N``): per phase (each anchor group's forward, its loss or head request, the
each group's backward, optimizer) its start, its span, its kernels' busy time and the GPU's idle
time inside it; the NCCL kernels' totals.

    python bench/profile_timeline.py runs/x/profile/drafter_rank0_step30.json [--json out.json]
    python bench/profile_timeline.py docs/results/2026-11-30-h200x2/m2_profile_call32.json.gz
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash_dist.step_trace import format_timeline, load_trace, timeline  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", help="Chrome trace JSON files (.json or .json.gz)")
    p.add_argument("--json", default=None, help="also write the timelines here")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
