"""bench/tau_compare.py without jobs: the runs' specs, the command each run gets, and the summary of finished runs
(the final evaluation, the last full window, the paired difference over the same prompts)."""

import json
import os
import sys
from types import SimpleNamespace

import pytest
from helpers.launch_util import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import tau_compare as T  # noqa: E402


def test_runs_are_named_and_split_as_a_shell_would():
    runs = T.parse_runs(["decay=", "kl=drafter.loss.kind=kl 'target.layer_ids=[1, 2]'"])
    assert runs == {"decay": [], "kl": ["drafter.loss.kind=kl", "target.layer_ids=[1, 2]"]}
    with pytest.raises(SystemExit):
        T.parse_runs(["decay=", "decay=drafter.loss.weighting=dpace"])  # one name, one run
    with pytest.raises(SystemExit):
        T.parse_runs(["drafter.loss.kind"])


def test_a_run_evaluates_every_held_out_prompt_at_the_end_with_its_own_overrides_last(tmp_path):
    args = SimpleNamespace(epochs=2, holdout=8, out_dir=str(tmp_path), set=["data.source=builtin_original"])
    cmd = T.job_command(str(tmp_path / "r"), ["drafter.loss.labels=target"], args)
    assert "train.eval_prompts=8" in cmd and "data.holdout=8" in cmd and "train.eval_every=0" in cmd
    assert cmd[-2:] == ["data.source=builtin_original", "drafter.loss.labels=target"]


def _run(path, taus, steps=(10, 20, 30, 35)):
    os.makedirs(path)
    rows = [{"kind": "train", "step": s, "loss": 1.0 / s, "acc": 0.1 * i} for i, s in enumerate(steps)]
    rows.append({"kind": "eval", "tau": sum(taus) / len(taus), "tau_stderr": 0.1, "tau_pooled": 2.0,
                 "n_prompts": len(taus), "acceptance_lengths": [[t, t] for t in taus]})
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")


def test_summary_takes_the_final_evaluation_the_last_full_window_and_pairs_prompts(tmp_path):
    _run(tmp_path / "a", [2.0, 3.0, 4.0])
    _run(tmp_path / "b", [2.5, 3.0, 5.0])
    a, b = T.summarize(str(tmp_path / "a")), T.summarize(str(tmp_path / "b"))
    assert a["steps"] == 35 and a["window"] == {"loss": 1.0 / 30, "acc": pytest.approx(0.2)}  # not the short last one
    assert a["per_prompt_tau"] == [2.0, 3.0, 4.0] and a["n_prompts"] == 3
    d = T.paired(a, b)
    assert d["mean"] == pytest.approx(0.5) and d["n_prompts"] == 3 and d["stderr"] > 0
    a["wall_s"], b["wall_s"], b["paired"] = 1.0, 2.0, d
    text = T.table({"a": a, "b": b})
    assert "| `b` | 35 | 3.500 ± 0.100 | 2.000 | +0.500 ±" in text
