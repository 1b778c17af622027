"""Tokenizing in-process against worker processes: where the crossover lies.

Tokenizes the first N conversations of a JSONL file (default: the packaged tiny corpus, repeated as needed) with
``dflash_dist.data.tokenize.build_tokenized_dataset`` at each ``--workers`` setting, forced (the row-count rule
of ``tokenize_workers`` bypassed), and prints seconds per run and the smallest row count at which each worker
setting beats in-process. A worker's start-up (a spawned interpreter importing transformers and loading the
tokenizer) is a fixed cost that only a large file repays.

    python bench/experiments/tokenize_workers.py --rows 120,1000,4000 --workers 0,2,4 [--tokenizer DIR] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _common
import _common as C  # noqa: F401, E402  (puts the repository on sys.path)

from dflash_dist.data.conversations import REGENERATED_JSONL  # noqa: E402
from dflash_dist.data.sources import read_conversations  # noqa: E402
from dflash_dist.data.tokenize import BadDataStats, build_tokenized_dataset  # noqa: E402
from dflash_dist.targets.hf import TINY_DIR  # noqa: E402


def time_one(convs: list, tokenizer: str, workers: int, max_length: int) -> float:
    t0 = time.perf_counter()
    ds = build_tokenized_dataset(convs, tokenizer, max_length, "truncate", workers, BadDataStats(),
                                 force_workers=True)
    assert len(ds) > 0
    return time.perf_counter() - t0


def crossover(rows: list, table: dict, workers: int):
    """The smallest measured row count at which ``workers`` processes beat in-process, or None."""
    wins = [n for n in rows if table[(n, workers)] < table[(n, 0)]]
    return min(wins) if wins else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default=REGENERATED_JSONL, help="JSONL of {messages} rows (repeated to --rows)")
    ap.add_argument("--tokenizer", default=TINY_DIR)
    ap.add_argument("--rows", default="120,1000,4000", help="comma-separated row counts")
    ap.add_argument("--workers", default="0,2,4", help="comma-separated worker counts (0 = in-process)")
    ap.add_argument("--max-length", type=int, default=3072)
    ap.add_argument("--out", default=None, help="also write the table as JSON")
    args = ap.parse_args(argv)
    rows = sorted(int(x) for x in args.rows.split(","))
    workers = sorted({0, *(int(x) for x in args.workers.split(","))})
    base = read_conversations(args.source, BadDataStats())
    table = {}
    for n in rows:
        convs = [dict(c) for c in itertools.islice(itertools.cycle(base), n)]
        for w in workers:
            table[(n, w)] = time_one(convs, args.tokenizer, w, args.max_length)
            print(f"rows {n:>7}  workers {w}  {table[(n, w)]:7.2f} s", flush=True)
    result = {"source": os.path.basename(args.source), "cpus": os.cpu_count(), "rows": rows, "workers": workers,
              "seconds": {f"{n}x{w}": round(s, 3) for (n, w), s in table.items()},
              "crossover_rows": {str(w): crossover(rows, table, w) for w in workers if w}}
    for w in workers:
        if w:
            c = result["crossover_rows"][str(w)]
            print(f"{w} workers beat in-process from {c} rows" if c else f"{w} workers never beat in-process here")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
