"""bench/optimizer_step.py --tiny: the fused steps on CPU (the compiled one runs on CUDA and says so in its row),
each timed; the flat-buffer step equal to the fused one; and the traced step of bench/drafter_step.py with its
phases."""

import json
import os
import subprocess
import sys

from helpers.launch_util import REPO


def _run(args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="disabled", PYTHONPATH=REPO)
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_optimizer_bench_times_each_mode(tmp_path):
    out = tmp_path / "opt.json"
    r = _run([os.path.join(REPO, "bench", "optimizer_step.py"), "--tiny", "--drafters", "dflash@8", "--repeats", "2",
              "--warmup", "1", "--out", str(out)])
    rows = {x["mode"]: x for x in json.load(open(out))["rows"]}
    assert r.returncode == 1, (r.stdout + r.stderr)[-3000:]  # the compiled row's error (CPU) fails the run
    assert set(rows) == {"fused", "compiled", "fused-noclip"}
    assert "runs on CUDA" in rows["compiled"]["error"]
    for mode in ("fused", "fused-noclip"):
        assert "error" not in rows[mode] and rows[mode]["ms"] > 0 and rows[mode]["params"] > 0


def test_flat_buffer_step_is_the_same_update(tmp_path):
    """The flat mode (one norm, one compiled elementwise AdamW over flat buffers) makes the weights the fused
    (here: eager) clip + AdamW makes, step for step; the copy mode times a plain copy of as many elements."""
    out = tmp_path / "opt.json"
    r = _run([os.path.join(REPO, "bench", "optimizer_step.py"), "--tiny", "--drafters", "dflash@8", "--modes",
              "fused,flat,copy", "--repeats", "2", "--warmup", "1", "--check-steps", "3", "--out", str(out)])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = {x["mode"]: x for x in json.load(open(out))["rows"]}
    assert rows["flat"]["max_abs_diff_vs_fused"] <= 1e-6 * rows["flat"]["max_weight"]
    assert rows["flat"]["bytes_per_param"] == 28 and rows["copy"]["bytes_per_param"] == 8
    assert rows["copy"]["gb_per_s"] > 0 and "max_abs_diff_vs_fused" not in rows["copy"]


def test_drafter_step_trace_has_every_phase(tmp_path):
    out, traces = tmp_path / "ds.json", tmp_path / "traces"
    r = _run([os.path.join(REPO, "bench", "drafter_step.py"), "--tiny", "--configs", "40x8", "--backends", "sdpa",
              "--repeats", "1", "--peak-n", "64", "--trace", str(traces), "--out", str(out)])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    row = json.load(open(out))["rows"][0]
    assert [p["name"] for p in row["timeline"]["phases"]] == ["batch", "mask", "forward", "loss", "variant_loss",
                                                               "backward", "optimizer"]
    assert row["mfu_back_to_back_pct"] > 0
    assert len(list(traces.iterdir())) == 1
