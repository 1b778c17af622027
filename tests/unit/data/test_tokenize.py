"""How many worker processes tokenize: none for a small file (a worker's start-up costs seconds), up to
data.num_workers and the CPUs for a large one (bench/experiments/tokenize_workers.py measures the crossover)."""

import itertools
import os
import time

import yaml

from dflash_dist.data import sources, tokenize
from dflash_dist.data.conversations import ASSETS_TINY, REGENERATED_JSONL, BadDataStats
from dflash_dist.data.tokenize import ROWS_PER_WORKER, tokenize_workers

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf", "data")


def test_workers_follow_the_row_count(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert tokenize_workers(120, 4) == 0
    assert tokenize_workers(2 * ROWS_PER_WORKER - 1, 4) == 0      # one worker only adds its start-up
    assert tokenize_workers(2 * ROWS_PER_WORKER, 4) == 2
    assert tokenize_workers(100 * ROWS_PER_WORKER, 4) == 4        # at most data.num_workers
    assert tokenize_workers(100 * ROWS_PER_WORKER, 0) == 0
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert tokenize_workers(100 * ROWS_PER_WORKER, 4) == 2        # at most the CPUs


def test_120_rows_with_the_presets_workers_tokenize_in_process_in_seconds(tmp_path, monkeypatch):
    with open(os.path.join(CONF, "jsonl.yaml")) as f:
        workers = yaml.safe_load(f)["num_workers"]
    assert workers > 0                                           # the preset asks for workers
    with open(REGENERATED_JSONL) as f:
        (tmp_path / "rows.jsonl").write_text("".join(itertools.islice(f, 120)))

    def no_pool(*a, **k):
        raise AssertionError("a worker pool was started for 120 rows")
    monkeypatch.setattr(sources, "ProcessPoolExecutor", no_pool)
    monkeypatch.setattr(tokenize, "ProcessPoolExecutor", no_pool)
    t0 = time.perf_counter()
    ds, held = sources.prepare_conversations(str(tmp_path / "rows.jsonl"), 12, 7, ASSETS_TINY, 3072, "truncate",
                                             workers, BadDataStats())
    assert time.perf_counter() - t0 < 5.0                      # was ~20 s with 4 spawned workers on 2 cores
    assert len(ds) == 108 and len(held) == 12
