"""bench/layer_bytes.py --tiny: inductor's byte count of one compiled drafter layer (forward + backward) per
drafter entry, settings given in the entry's label reaching the layer."""

import json
import os
import subprocess
import sys

from helpers.launch_util import REPO


def test_layer_bytes_counts_each_drafter_and_setting(tmp_path):
    out = tmp_path / "lb.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "layer_bytes.py"), "--tiny", "--drafters",
                        "dflash@8,dflash2@8,dflash2@8:dflash2.conv_dtype=input", "--out", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    mb = {row["drafter"]: row["inductor_mb"] for row in json.load(open(out))["rows"]}
    # DFlash2's convolutions add bytes to the layer; run on bf16 inputs (the default) they add fewer than on the
    # fp32 norm output (the setting reached it)
    assert 0 < mb["dflash@8"] < mb["dflash2@8"] < mb["dflash2@8:dflash2.conv_dtype=input"]


def test_saved_bytes_per_layer_by_weight_dtype(tmp_path):
    out = tmp_path / "saved.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "layer_bytes.py"), "--tiny", "--saved",
                        "--drafters", "dflash@8", "--out", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    row = json.load(open(out))["rows"][0]
    # fp32 master weights under autocast: the layer also keeps the bf16 copy of every weight it multiplied with;
    # gathered in bf16 (FSDP2) it keeps none of them
    H, A, Akv, inter = 128, 4 * 32, 2 * 32, 384  # --tiny: q, k, v, o projections and the MLP's three
    matmul_weights_mb = 2 * (2 * H * A + 2 * H * Akv + 3 * H * inter) / 1e6
    weights_bf16 = row["saved_mb_fp32_weights_by_dtype"]["bfloat16"] - row["saved_mb_bf16_weights_by_dtype"]["bfloat16"]
    assert abs(weights_bf16 - matmul_weights_mb) < 0.05 * matmul_weights_mb, (weights_bf16, matmul_weights_mb)
    assert 0 < row["saved_mb_bf16_weights"] < row["saved_mb_fp32_weights"]
    assert row["plan_eager_count_mb"] > 0
