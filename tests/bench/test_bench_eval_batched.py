"""bench/eval_batched.py's comparison: every batch size against the smallest one, in whatever order they ran (its
dflash-eval runs are the project's command, tested elsewhere)."""

from helpers.bench_scripts import load_bench


def load():
    return load_bench("eval_batched")


def test_batch_sizes_given_largest_first_compare_against_batch_one():
    rows = [{"batch_size": 16, "tokens_per_s": 140.0, "lengths": [[1, 2], [3], [1]]},
            {"batch_size": 4, "tokens_per_s": 40.0, "lengths": [[1, 2], [2], [1]]},
            {"batch_size": 1, "tokens_per_s": 20.0, "lengths": [[1, 2], [2], [1, 1]]}]
    base = load().against_smallest(rows)
    assert base["batch_size"] == 1
    assert [r["speedup"] for r in rows] == [7.0, 2.0, 1.0]
    assert [r["prompts_same_lengths"] for r in rows] == [1, 2, 3]
