"""The update does not depend on how a step's samples are split: the same blocks through 1 drafter x 2
micro-batches and 2 drafters x 1 give the same weights after 5 steps (decay and D-PACE weighting, the data's and
the target's labels, KL to the target's top-k), because every loss sum is divided by the step's weight sum over all
ranks and micro-batches. A per-rank denominator (the weight sum's all-reduce skipped) breaks it: the last cases
show the difference is seen."""

import torch
from helpers.launch_util import torchrun

WORKER = "tests/helpers/split_invariance_worker.py"


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def test_same_samples_same_update_whether_split_over_ranks_or_micro_batches(tmp_path):
    for n in (1, 2):
        r = torchrun(n, [WORKER, "--out", tmp_path], timeout=400)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    one = torch.load(tmp_path / "world1_rank0.pt")
    two = [torch.load(tmp_path / f"world2_rank{i}.pt") for i in range(2)]
    # each objective trains differently from the one it is compared with (so equal weights are not trivial)
    other = {"decay": "dpace", "dpace": "decay", "target": "decay", "target-dpace": "target", "kl": "target"}
    for name, ref in other.items():
        assert _max_diff(two[0][name], two[1][name]) == 0.0            # DDP keeps the ranks equal
        assert _max_diff(one[name], one[ref]) > 1e-4, name
        for k, v in one[name].items():
            torch.testing.assert_close(two[0][name][k], v, rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")
    # a per-rank denominator: the same samples, another update (same weights with one rank: no all-reduce)
    for name in ("dpace", "target", "kl"):
        assert _max_diff(one[f"{name}-per-rank"], one[name]) == 0.0, name
        assert _max_diff(two[0][f"{name}-per-rank"], one[name]) > 1e-4, name
