"""bench/memory_plan.py --tiny: a drafter rank's memory plan against its measured peak (CPU: the live tensors'
resident peak) for DDP, FSDP2 and Domino, each case in its own process, the step timed; a case that fails is
reported in its row and fails the run without stopping the others."""

import json
import os
import subprocess
import sys

from helpers.launch_util import REPO


def _run(args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="disabled", PYTHONPATH=REPO)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)  # the bench sets it for its cases
    return subprocess.run([sys.executable, os.path.join(REPO, "bench", "memory_plan.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_plan_against_peak_per_case(tmp_path):
    out = tmp_path / "mp.json"
    r = _run(["--tiny", "--warmup", "1", "--steps", "2", "--out", str(out), "--case", "ddp:drafter.parallel=ddp",
              "--case", "fsdp:drafter.parallel=fsdp", "--case", "domino:drafter=tiny_domino drafter.parallel=ddp",
              "--case", "bad:drafter.num_anchors=0"])
    assert r.returncode == 1, (r.stdout + r.stderr)[-3000:]  # the bad case
    rows = {x["label"]: x for x in json.load(open(out))["rows"]}
    assert "error" in rows["bad"] and "num_anchors" in rows["bad"]["error"]
    for label in ("ddp", "fsdp", "domino"):
        row = rows[label]
        assert "error" not in row, row
        assert row["parallel"] == ("fsdp" if label == "fsdp" else "ddp")
        assert (row["b"], row["Q"]) == (15, 256) and row["ms_per_step"] > 0
        assert 0.85 <= row["planned_over_measured"] <= 1.15, row
    assert rows["domino"]["planned_gib"] > rows["ddp"]["planned_gib"]
    assert "| ddp | ddp | 15 |" in r.stdout


def test_peak_by_source_groups_what_is_live_at_the_peak():
    sys.path.insert(0, os.path.join(REPO, "bench"))
    from memory_plan import GiB, peak_by_source

    def ev(action, addr, size, where):
        return {"action": action, "addr": addr, "size": size,
                "frames": [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
                           {"filename": f"/r/dflash_dist/{where}.py", "line": 7, "name": "f"}]}
    events = [ev("alloc", 1, GiB, "a"), ev("alloc", 2, 2 * GiB, "b"), ev("alloc", 3, GiB, "b"),
              ev("free_completed", 2, 2 * GiB, "b"),  # the peak (4 GiB) was before this free
              ev("alloc", 4, GiB, "c"), ev("free_completed", 1, GiB, "a")]
    out = peak_by_source(events)
    assert out == {"b.py:7 f": 3.0, "a.py:7 f": 1.0}  # the innermost frame in the project's code names it
    assert peak_by_source(events, top=1) == {"b.py:7 f": 3.0, "(other)": 1.0}
