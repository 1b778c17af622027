#!/usr/bin/env python3
"""Summary of a target trace (``logging.debug.trace_target=true``: <run>/target_trace/rank<r>.jsonl): per column the
median and the maximum over the messages after the first --skip (load and compile), and the share of the traced
time each part took.

    python bench/trace_summary.py runs/x/target_trace/rank1.jsonl [--skip 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

PARTS = ("stall_ms", "capture_ms", "backpressure_ms", "eval_ms")  # eval_ms: absent in older traces


def summarize(rows: list[dict]) -> dict:
    parts = [k for k in PARTS if all(k in r for r in rows)]
    total = sum(r[k] for r in rows for k in parts) or 1.0
    return {k: {"median": statistics.median(r[k] for r in rows), "max": max(r[k] for r in rows),
                "share": sum(r[k] for r in rows) / total} for k in parts}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--skip", type=int, default=10, help="leave out the first N messages")
    args = p.parse_args(argv)
    with open(args.trace) as f:
        rows = [json.loads(line) for line in f][args.skip:]
    if not rows:
        print(f"{args.trace}: no messages after the first {args.skip}")
        return 1
    s = summarize(rows)
    print(f"target trace, {len(rows)} messages after the first {args.skip}: " + ", ".join(
        f"{k} median {v['median']:.1f} max {v['max']:.1f} ({100 * v['share']:.0f}%)" for k, v in s.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
