"""The memory plan refuses a job that cannot fit before any model loads (at the batches its data makes): the GPU
presets on the CPU default, and a rank of either role under ``ulimit -v`` (dflash-train, CPU): one line, exit 2, in
seconds."""

import os
import resource
import subprocess
import sys
import time

import pytest
from helpers.launch_util import REPO


def dflash_train(args: list, cwd, preexec_fn=None):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               WANDB_MODE="disabled")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "dflash_dist.cli.train", "--nproc-per-node", "3", *args,
                        f"train.output_dir={cwd / 'run'}"], cwd=str(cwd), env=env, capture_output=True, text=True,
                       timeout=120, preexec_fn=preexec_fn)
    return r, time.monotonic() - t0


@pytest.mark.parametrize("drafter", ["dflash2", "domino"])
def test_gpu_presets_on_the_cpu_default_are_refused_in_seconds(tmp_path, drafter):
    r, took = dflash_train([f"drafter={drafter}"], tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    line = next(x for x in out.splitlines() if "configuration error: memory plan" in x)
    assert "drafter ranks on this machine need" in line and " GiB but " in line and "drafter.num_anchors" in line
    assert "Traceback" not in out and "target loaded" not in out and took < 60
    assert not (tmp_path / "run" / "checkpoints").exists()


def _limit(gib: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (gib << 30, gib << 30))
    return apply


@pytest.mark.parametrize("args, role, knob", [
    (["drafter.num_anchors=512"], "drafter", "drafter.num_anchors"),
    (["target=tiny_mistral", "target.hf_config.max_position_embeddings=32768", "target.max_batch_tokens=262144",
      "data.max_length=32768"], "target",
     "target.max_batch_tokens"),
])
def test_a_rank_under_ulimit_v_is_refused_with_numbers(tmp_path, args, role, knob):
    r, took = dflash_train(args, tmp_path, preexec_fn=_limit(8))
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    line = next(x for x in out.splitlines() if "configuration error: memory plan" in x)
    assert f"a {role} rank's process need" in line and "but ulimit -v (8.00 GiB" in line and knob in line, line
    assert "Traceback" not in out and took < 60
