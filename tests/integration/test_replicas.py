"""Target replicas (target.tensor_parallel) and node-local routing under torchrun on CPU (gloo)."""

import json
import os

import pytest
from launch_util import torchrun

FEATURE_TOL = 1e-4  # fp32, hidden size 128: the sharded sums reorder the reductions (measured ~5e-6)


@pytest.mark.parametrize("random_init", [False, True])
def test_replica_features_equal_one_rank(tmp_path, random_init):
    """A replica of 2 ranks captures the same features as the whole target on one rank (fp32, within FEATURE_TOL),
    both ranks of the replica hold the same features, and each holds about half the parameter bytes."""
    out = tmp_path / "rep"
    r = torchrun(2, ["tests/tp_features_worker.py", "--out", str(out)] + (["--random"] if random_init else []),
                 timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    reps = [json.load(open(f"{out}.rank{i}.json")) for i in range(2)]
    assert reps[0]["max_abs_diff"] < FEATURE_TOL, reps[0]
    assert reps[0]["max_abs_ref"] > 0.1  # features of a real magnitude were compared
    assert all(x["ranks_agree"] for x in reps)
    for x in reps:  # no rank holds the whole model: replicated norms only beside the halves
        assert x["local_bytes"] < 0.55 * x["full_bytes"], x


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _train(run_dir):
    return [r for r in _metrics(run_dir) if r["kind"] == "train"]


def _accounting(run_dir):
    return [r for r in _metrics(run_dir) if r["kind"] == "accounting"][-1]


def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


JOB = ["-m", "dflash_dist.train", "logging.log_every=1", "logging.progress_bar=false", "logging.wandb.mode=disabled",
       "train.eval_prompts=0", "logging.record_sample_ids=true", "logging.trace_target=true"]
LOSS_RTOL = 1e-3  # the replica's features differ from one rank's by ~1e-6 relative (FEATURE_TOL above)


def test_replica_of_two_trains_like_one_target_rank(tmp_path):
    """3 ranks (1 drafter + one replica of 2) against 1 + 1 on the same plan: exit 0, closed sample accounting, the
    same loss at every step within LOSS_RTOL; only the replica's first rank sent (target trace, sample log)."""
    steps = 8
    one, rep = tmp_path / "k1", tmp_path / "k2"
    r1 = torchrun(2, JOB + [f"train.output_dir={one}", f"train.max_steps={steps}"], timeout=300)
    assert r1.returncode == 0, (r1.stdout + r1.stderr)[-4000:]
    r2 = torchrun(3, JOB + [f"train.output_dir={rep}", f"train.max_steps={steps}", "topology.target_ranks=2",
                            "target.tensor_parallel=2"], timeout=300)
    out = r2.stdout + r2.stderr
    assert r2.returncode == 0, out[-4000:]
    assert "replica 0 ranks [1, 2], tensor-parallel: this rank holds" in out
    assert "replica 0 rank 2:" in out and "(features sent by rank 1)" in out
    a, b = _train(one), _train(rep)
    assert [x["step"] for x in a] == [x["step"] for x in b] == list(range(1, steps + 1))
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= LOSS_RTOL * abs(x["loss"]), (x["step"], x["loss"], y["loss"])
    acc = _accounting(rep)
    assert acc["samples_sent"] == acc["samples_received"] + acc["samples_dropped_after_stop"]
    assert acc["samples_received"] == (acc["samples_trained"] + acc["samples_skipped_nonfinite"]
                                       + acc["samples_skipped_shape"])
    assert acc["samples_trained"] == _accounting(one)["samples_trained"] > 0
    assert not os.path.exists(rep / "target_trace" / "rank2.jsonl")  # the follower sends nothing
    assert {x["from"] for x in _jsonl(rep / "sample_log" / "rank0.jsonl")} == {1}
