"""dflash-doctor: exits 0 on this CPU machine, non-zero on a FAIL, never waits long on the network."""

import json
import os
import subprocess
import sys
import time

from helpers.launch_util import REPO as REPO_ROOT

from dflash_dist.cli import doctor

ROOT = REPO_ROOT


def _run(*args, timeout=360):
    # the doctor compiles flex_attention on the CPU: ~100 s on a 2-core machine already busy with other tests
    env = dict(os.environ, WANDB_MODE="offline")
    return subprocess.run([sys.executable, "-m", "dflash_dist.cli.doctor", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_doctor_exits_zero_on_cpu(tmp_path):
    out = tmp_path / "doctor.json"
    p = _run("--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {r["check"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["flex_attention"]["status"] == "PASS"         # compiled forward matches the dense reference
    assert rows["config"]["status"] == "PASS" and rows["torch"]["status"] == "PASS"
    assert rows["wandb"]["status"] == "PASS" and "offline" in rows["wandb"]["detail"]
    for name in ("NCCL", "P2P access", "P2P bandwidth"):      # no GPU here
        assert rows[name]["status"] == "N/A"
    assert "STATUS" in p.stdout and "flex_attention" in p.stdout


def test_doctor_fails_on_a_bad_config():
    p = _run("--no-flex", "drafter.num_layers=0")
    assert p.returncode == 1
    assert "FAIL" in p.stdout and "num_layers" in p.stdout


def test_wandb_online_without_network_warns(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setattr(doctor, "_tcp_reachable", lambda host, port, timeout_s=2.0: False)
    doc = doctor.Doctor()
    doctor.check_wandb(doc)
    assert doc.rows[0]["status"] == "WARN" and "offline" in doc.rows[0]["detail"]


def test_network_probe_is_bounded():
    t0 = time.monotonic()
    doctor._tcp_reachable("10.255.255.1", 443, timeout_s=0.5)   # non-routable: would hang without the bound
    assert time.monotonic() - t0 < 1.5


def test_export_check_passes_a_complete_export_and_names_what_is_missing(tmp_path):
    from dflash_dist.export.write import export_checkpoint
    from tests.unit.export.test_export import make_checkpoint, make_drafter
    model = make_drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    ckpt, _ = make_checkpoint(tmp_path, model)
    out = export_checkpoint(ckpt, str(tmp_path / "e"), tokenizer=False)
    doc = doctor.Doctor()
    doctor.check_export(doc, out)
    assert doc.rows[-1]["status"] == "PASS", doc.rows[-1]
    assert "window 6" in doc.rows[-1]["detail"] and "'<|MASK|>' = 3" in doc.rows[-1]["detail"]
    cfg_path = os.path.join(out, "config.json")
    cfg = json.load(open(cfg_path))
    for k in ("rope_theta", "eagle_aux_hidden_state_layer_ids"):
        cfg.pop(k)
    cfg["use_sliding_window"] = False
    json.dump(cfg, open(cfg_path, "w"))
    os.unlink(os.path.join(out, "modeling_dflash.py"))
    doctor.check_export(doc, out)
    row = doc.rows[-1]
    assert row["status"] == "FAIL"
    for what in ("rope_theta", "eagle_aux_hidden_state_layer_ids", "modeling_dflash.py", "use_sliding_window"):
        assert what in row["detail"], what
    doctor.check_export(doc, str(tmp_path / "nowhere"))
    assert doc.rows[-1]["status"] == "FAIL"
