"""dflash-doctor runs the checks training makes before any model loads, with the same overrides: it refuses what
dflash-train refuses (exit 1, the same message) and passes what training accepts."""

import os
import re
import subprocess
import sys

from helpers.launch_util import REPO, torchrun

from dflash_dist.cli import doctor


def _error_line(text: str) -> str:
    m = re.search(r"configuration error: (.*)", text)
    assert m, text[-3000:]
    return m.group(1).strip()


def test_doctor_refuses_what_training_refuses_with_its_message(tmp_path):
    overrides = ["target.layer_ids=[1,7]"]              # the tiny target's last layer
    r = torchrun(2, ["-m", "dflash_dist.train", f"train.output_dir={tmp_path}", "logging.wandb.mode=disabled",
                     *overrides], timeout=180)
    assert r.returncode != 0 and "target loaded" not in r.stdout + r.stderr  # torchrun exits 1 (ranks: 2)
    trained = _error_line(r.stdout + r.stderr)
    p = subprocess.run([sys.executable, "-m", "dflash_dist.cli.doctor", "--no-flex", *overrides], cwd=REPO,
                       env=dict(os.environ, WANDB_MODE="offline"), capture_output=True, text=True, timeout=180)
    assert p.returncode == 1, p.stdout + p.stderr
    row = next(x for x in p.stdout.splitlines() if x.startswith("config "))
    assert "FAIL" in row and _error_line(row) == trained and "last decoder layer" in trained


def _config_row(overrides, world_size=None):
    doc = doctor.Doctor()
    doc.run("config", lambda d: doctor.check_config(d, overrides, world_size))
    return doc.rows[0]


def test_doctor_passes_a_shallow_target_and_names_its_layer_ids_and_attention():
    row = _config_row(["target=tiny_gpt_oss", "target.hf_config.num_hidden_layers=4",
                       "target.hf_config.layer_types=[sliding_attention,full_attention,sliding_attention,"
                       "full_attention]"])
    assert row["status"] == "PASS", row
    assert "4 layers" in row["detail"] and "layer ids [0, 1, 2]" in row["detail"]
    assert "attention eager on cpu" in row["detail"]


def test_doctor_checks_the_split_with_the_world_size():
    assert _config_row(["topology.target_ranks=2"])["status"] == "PASS"    # no world size: not checked
    row = _config_row(["topology.target_ranks=2"], world_size=2)
    assert row["status"] == "FAIL" and "topology.target_ranks=2 leaves no drafter rank" in row["detail"]
