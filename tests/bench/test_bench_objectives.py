"""bench/objectives.py --tiny: one drafter step per objective for two drafters on CPU, each row through its own
objective (its description and its own loss sum), the decay row the 1.0 of its drafter."""

import json
import os
import subprocess
import sys

from helpers.launch_util import REPO


def test_objectives_bench_times_every_objective(tmp_path):
    out = tmp_path / "obj.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="disabled", PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "objectives.py"), "--tiny", "--configs", "40x8",
                        "--repeats", "1", "--drafters", "dflash@8,dflash2@8", "--kl-top-k", "4", "--out", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = json.load(open(out))["rows"]
    assert [(x["drafter"], x["objective"]) for x in rows] == [
        (d, o) for d in ("dflash@8", "dflash2@8") for o in ("decay", "dpace", "target", "kl")]
    assert all("error" not in x and x["mode"] == "train" and x["ms_per_step"] > 0 for x in rows)
    by = {(x["drafter"], x["objective"]): x for x in rows}
    for d in ("dflash@8", "dflash2@8"):
        assert by[d, "decay"]["vs_decay"] == 1.0 and by[d, "kl"]["vs_decay"] > 0
        assert "D-PACE" in by[d, "dpace"]["describe"] and "top-4" in by[d, "kl"]["describe"]
        assert len({by[d, o]["loss_sum"] for o in ("decay", "dpace", "target", "kl")}) == 4
    assert "| dflash2@8 | kl |" in r.stdout
