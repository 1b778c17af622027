"""Hostile checkpoints and exports: nothing in one selects code, network or paths outside it.

Each case is a real checkpoint (the project's save_checkpoint of a tiny drafter) or export (export_checkpoint),
then corrupted. The command lines must refuse it with exactly one ``checkpoint error:`` line naming the file and
the field, exit 2, no traceback, within 10 s, without one network connection (HF_HUB_OFFLINE is not set: the
socket layer is watched instead)."""

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time

import pytest
import torch
from tests.unit.export.test_export import make_checkpoint

from dflash_dist.export.write import export_checkpoint
from dflash_dist.export.load import META_NAME, CheckpointInputError, load_export
from dflash_dist.checkpoint.store import CheckpointError, checkpoint_problem, find_latest, load_checkpoint
from dflash_dist.cli.doctor import Doctor, check_export
from dflash_dist.cli.eval import main as eval_main
from dflash_dist.cli.export import main as export_main


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Every attempt to resolve or connect is recorded and fails at once; the test asserts there was none."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    attempts = []

    def refuse(*a, **k):
        attempts.append(a[:2])
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", lambda self, *a: refuse(*a))
    monkeypatch.setattr(socket, "create_connection", refuse)
    yield attempts
    assert attempts == [], f"network contacted: {attempts}"


def edit_meta(ckpt: str, fn) -> None:
    path = os.path.join(ckpt, "meta.json")
    meta = json.load(open(path))
    fn(meta)
    with open(path, "w") as f:
        json.dump(meta, f)


def refresh_size(ckpt: str, name: str) -> None:
    edit_meta(ckpt, lambda m: m["files"].__setitem__(name, os.path.getsize(os.path.join(ckpt, name))))


def refused(capsys, main, argv, file: str, field: str) -> str:
    """Run a command line in-process: exit 2, one ``checkpoint error:`` line naming ``file`` and ``field``, no
    traceback, under 10 s. Returns stderr."""
    capsys.readouterr()
    t0 = time.perf_counter()
    rc = main(argv)
    took = time.perf_counter() - t0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "checkpoint error:" in ln]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert file in lines[0] and field in lines[0], lines[0]
    assert "Traceback" not in err
    assert took < 10, took
    return lines[0]


def eval_argv(tmp_path, ckpt=None, export=None):
    rows = tmp_path / "p.jsonl"
    rows.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    src = ["--checkpoint", ckpt] if ckpt else ["--export", export]
    return src + ["--prompts", str(rows), "--max-new-tokens", "2", "--out", str(tmp_path / "eval.json")]


def test_hub_attention_kernel_in_meta(tmp_path, capsys):
    """A Hub kernel named in a file never reaches transformers; named on the command line, the file's is unused."""
    ckpt, _ = make_checkpoint(tmp_path)
    edit_meta(ckpt, lambda m: m["job_config"]["target"].__setitem__("attn_implementation",
                                                                     "kernels-community/evil-attn"))
    refused(capsys, eval_main, eval_argv(tmp_path, ckpt), "meta.json", "job_config.target.attn_implementation")
    # export builds no target: the value is data, carried into the export's provenance file, refused there
    out = export_checkpoint(ckpt, str(tmp_path / "e"), dtype="float32")
    refused(capsys, eval_main, eval_argv(tmp_path, export=out), META_NAME, "target.attn_implementation")
    assert eval_main(eval_argv(tmp_path, export=out) + ["--attn-implementation", "eager"]) == 0
    side = json.load(open(os.path.join(out, META_NAME)))
    side["target"].update(attn_implementation="sdpa", experts_implementation="evil-org/experts")
    json.dump(side, open(os.path.join(out, META_NAME), "w"))
    refused(capsys, eval_main, eval_argv(tmp_path, export=out), META_NAME, "target.experts_implementation")


@pytest.mark.parametrize("field", ["variant", "loss.objective"])
def test_code_named_in_meta_is_never_imported(tmp_path, capsys, monkeypatch, field):
    """A ``module:Class`` variant or objective in meta.json is refused unless the program imported that module
    itself: the module (on sys.path, so an import would succeed) never runs."""
    mods, ran = tmp_path / "mods", tmp_path / "ran"
    mods.mkdir()
    (mods / "evil_part.py").write_text(f"open({str(ran)!r}, 'w').write('ran')\nclass Part:\n    name = 'x'\n")
    monkeypatch.syspath_prepend(str(mods))
    ckpt, _ = make_checkpoint(tmp_path)
    settings = {"variant": "dflash", "loss": {"objective": "decayed_ce"}}
    if field == "variant":
        settings["variant"] = "evil_part:Part"
    else:
        settings["loss"]["objective"] = "evil_part:Part"
    edit_meta(ckpt, lambda m: m.__setitem__("drafter", settings))
    refused(capsys, export_main, [ckpt, str(tmp_path / "e")], "meta.json", f"drafter.{field}")
    refused(capsys, eval_main, eval_argv(tmp_path, ckpt), "meta.json", f"drafter.{field}")
    assert f"drafter.{field}" in (checkpoint_problem(ckpt) or "")  # a resume skips it too
    assert not ran.exists()


def test_hub_tokenizer_id_in_meta(tmp_path, capsys):
    ckpt, _ = make_checkpoint(tmp_path)
    edit_meta(ckpt, lambda m: m.__setitem__("tokenizer", "attacker-org/evil-tokenizer"))
    refused(capsys, export_main, [ckpt, str(tmp_path / "x")], "meta.json", "tokenizer")
    refused(capsys, eval_main, eval_argv(tmp_path, ckpt), "meta.json", "tokenizer")
    assert not os.path.exists(tmp_path / "x")


def test_hub_id_in_meta_loads_from_the_local_cache(tmp_path, monkeypatch):
    """A run trained on a Hub id still exports: the meta's id is read from its snapshot in the local Hugging Face
    cache (no network: the fixture fails the test on any connection)."""
    import huggingface_hub.constants as hub

    from dflash_dist.targets.hf import TINY_DIR
    snap = tmp_path / "hub" / "models--some-org--some-model" / "snapshots" / "abc123"
    shutil.copytree(TINY_DIR, snap, ignore=shutil.ignore_patterns("*.safetensors", "*.jsonl"))
    (tmp_path / "hub" / "models--some-org--some-model" / "refs").mkdir()
    (tmp_path / "hub" / "models--some-org--some-model" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    ckpt, _ = make_checkpoint(tmp_path)
    edit_meta(ckpt, lambda m: m.__setitem__("tokenizer", "some-org/some-model"))
    out = export_checkpoint(ckpt, str(tmp_path / "e"))
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    assert json.load(open(os.path.join(out, META_NAME)))["tokenizer_source"] == "some-org/some-model"


def test_files_entry_leaving_the_directory(tmp_path, capsys):
    ckpt, _ = make_checkpoint(tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x" * 12345)
    rel = os.path.relpath(outside, ckpt)
    assert rel.startswith("..")
    edit_meta(ckpt, lambda m: m["files"].__setitem__(rel, 1))
    line = refused(capsys, export_main, [ckpt, str(tmp_path / "x")], "meta.json", "files")
    assert "12345" not in line  # the outside file was not even measured
    assert "not a plain file name" in checkpoint_problem(ckpt)


def test_symlink_out_of_the_directory(tmp_path, capsys):
    ckpt, _ = make_checkpoint(tmp_path)
    st = os.path.join(ckpt, "model.safetensors")
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(st, outside)
    os.symlink(outside, st)  # a valid weights file, same size: only where it lives is wrong
    refused(capsys, export_main, [ckpt, str(tmp_path / "x")], "model.safetensors", "symlink")
    assert "outside the directory" in checkpoint_problem(ckpt)
    # an export whose tokenizer file points out of it
    good, _ = make_checkpoint(tmp_path, run="good")
    out = export_checkpoint(good, str(tmp_path / "e"), dtype="float32")
    tok = os.path.join(out, "tokenizer.json")
    shutil.move(tok, tmp_path / "tok.json")
    os.symlink(tmp_path / "tok.json", tok)
    refused(capsys, eval_main, eval_argv(tmp_path, export=out), "tokenizer.json", "symlink")
    os.unlink(tok)
    shutil.move(tmp_path / "tok.json", os.path.join(out, "tok.json"))
    os.symlink("tok.json", tok)  # a link that stays inside the directory is fine
    load_export(out)
    os.symlink(os.path.dirname(out), os.path.join(out, "up"))  # one to the parent directory is not
    with pytest.raises(CheckpointInputError, match="up: file: a symlink"):
        load_export(out)


HUGE_VOCAB_SCRIPT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
from dflash_dist.cli.eval import main
sys.exit(main(sys.argv[1:]))
"""


def test_huge_vocab_refused_before_allocating(tmp_path, capsys):
    """drafter_config / target_config / the random-init target's vocab_size of 2^33: refused by its bound, under
    a 6 GB address-space limit (building that target would need a terabyte)."""
    ckpt, _ = make_checkpoint(tmp_path)

    def huge(m):
        for d in (m["drafter_config"], m["target_config"], m["job_config"]["target"]["hf_config"]):
            d["vocab_size"] = 1 << 33
    edit_meta(ckpt, huge)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", HUGE_VOCAB_SCRIPT, *eval_argv(tmp_path, ckpt)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if "checkpoint error:" in ln]
    assert len(lines) == 1 and "meta.json" in lines[0] and "drafter_config.vocab_size" in lines[0], p.stderr
    assert "Traceback" not in p.stderr and time.perf_counter() - t0 < 60
    refused(capsys, export_main, [ckpt, str(tmp_path / "x")], "meta.json", "drafter_config.vocab_size")


def test_unknown_key(tmp_path, capsys):
    ckpt, _ = make_checkpoint(tmp_path)
    edit_meta(ckpt, lambda m: m["job_config"]["target"].__setitem__("trust_remote_code", True))
    refused(capsys, eval_main, eval_argv(tmp_path, ckpt), "meta.json", "job_config.target.trust_remote_code")
    edit_meta(ckpt, lambda m: (m["job_config"]["target"].pop("trust_remote_code"), m.__setitem__("evil", 1)))
    refused(capsys, export_main, [ckpt, str(tmp_path / "x")], "meta.json", "evil")
    edit_meta(ckpt, lambda m: (m.pop("evil"), m["drafter_config"].__setitem__("bogus", 1)))
    refused(capsys, eval_main, eval_argv(tmp_path, ckpt), "meta.json", "drafter_config.bogus")


def test_wrong_type(tmp_path, capsys):
    ckpt, _ = make_checkpoint(tmp_path)
    edit_meta(ckpt, lambda m: m["drafter_config"].__setitem__("hidden_size", "32"))
    refused(capsys, export_main, [ckpt, str(tmp_path / "x")], "meta.json", "drafter_config.hidden_size")
    edit_meta(ckpt, lambda m: (m["drafter_config"].__setitem__("hidden_size", 32),
                               m["job_config"]["data"].__setitem__("holdout", [1])))
    refused(capsys, eval_main, eval_argv(tmp_path, ckpt), "meta.json", "job_config.data.holdout")
    edit_meta(ckpt, lambda m: (m["job_config"]["data"].__setitem__("holdout", 0),
                               m.__setitem__("layer_ids", "1,3,4")))
    refused(capsys, eval_main, eval_argv(tmp_path, ckpt), "meta.json", "layer_ids")
    # an export's config.json
    good, _ = make_checkpoint(tmp_path, run="good")
    out = export_checkpoint(good, str(tmp_path / "e"), dtype="float32")
    cfg_path = os.path.join(out, "config.json")
    cfg = json.load(open(cfg_path))
    json.dump(dict(cfg, rms_norm_eps="tiny"), open(cfg_path, "w"))
    refused(capsys, eval_main, eval_argv(tmp_path, export=out), "config.json", "rms_norm_eps")
    json.dump(dict(cfg, num_key_value_heads=3), open(cfg_path, "w"))  # an int, but does not divide 4 heads
    refused(capsys, eval_main, eval_argv(tmp_path, export=out), "config.json", "num_key_value_heads")


def test_negative_mask_token_id(tmp_path, capsys):
    ckpt, _ = make_checkpoint(tmp_path)
    edit_meta(ckpt, lambda m: m.__setitem__("mask_token_id", -1))
    refused(capsys, eval_main, eval_argv(tmp_path, ckpt), "meta.json", "mask_token_id")
    refused(capsys, export_main, [ckpt, str(tmp_path / "x")], "meta.json", "mask_token_id")
    good, _ = make_checkpoint(tmp_path, run="good")
    out = export_checkpoint(good, str(tmp_path / "e"), dtype="float32")
    cfg = json.load(open(os.path.join(out, "config.json")))
    cfg["dflash_config"]["mask_token_id"] = -1
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    refused(capsys, eval_main, eval_argv(tmp_path, export=out), "config.json", "dflash_config.mask_token_id")


def write_huge_header(path: str) -> None:
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 60))


def test_safetensors_header_of_2_60_bytes(tmp_path, capsys):
    ckpt, _ = make_checkpoint(tmp_path)
    write_huge_header(os.path.join(ckpt, "model.safetensors"))  # same size: only the header lies
    refused(capsys, export_main, [ckpt, str(tmp_path / "x")], "model.safetensors", "header length")
    refused(capsys, eval_main, eval_argv(tmp_path, ckpt), "model.safetensors", "header length")
    good, _ = make_checkpoint(tmp_path, run="good")
    out = export_checkpoint(good, str(tmp_path / "e"), dtype="float32")
    write_huge_header(os.path.join(out, "model.safetensors"))
    refused(capsys, eval_main, eval_argv(tmp_path, export=out), "model.safetensors", "header length")
    doc = Doctor()
    check_export(doc, out)
    assert doc.rows[-1]["status"] == "FAIL" and "header length" in doc.checkpoint_error


@pytest.mark.parametrize("state, field", [
    ({"state": {}, "param_groups": [{"lr": 1e-3}]}, "param_groups[0].params"),           # KeyError before
    ({"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [{"params": [0]}]}, "state[0].exp_avg"),
    ({"state": {}, "groups": []}, "state_dict"),
    ([1, 2, 3], "state_dict"),
])
def test_optimizer_of_wrong_structure(tmp_path, state, field):
    """Plain tensors and values (weights_only loads them) in the wrong structure: checkpoint_problem (what a
    resume checks) names optimizer.pt and the field; load_checkpoint raises CheckpointError, not a KeyError."""
    ckpt, _ = make_checkpoint(tmp_path)
    torch.save(state, os.path.join(ckpt, "optimizer.pt"))
    refresh_size(ckpt, "optimizer.pt")
    problem = checkpoint_problem(ckpt)
    assert problem is not None and "optimizer.pt" in problem and field in problem, problem
    assert find_latest(str(tmp_path / "run")) is None
    with pytest.raises(CheckpointError, match="optimizer.pt"):
        load_checkpoint(ckpt)
    assert checkpoint_problem(ckpt, optimizer=False) is None  # export / eval never open it


def test_well_formed_optimizer_passes(tmp_path):
    from tests.unit.export.test_export import make_drafter
    model = make_drafter()
    opt = torch.optim.AdamW(model.parameters())
    model.fc.weight.sum().backward()
    opt.step()
    ckpt, _ = make_checkpoint(tmp_path, model)
    torch.save(opt.state_dict(), os.path.join(ckpt, "optimizer.pt"))
    refresh_size(ckpt, "optimizer.pt")
    assert checkpoint_problem(ckpt) is None
    _, state, _ = load_checkpoint(ckpt)
    assert set(state) == {"state", "param_groups"}


@pytest.mark.parametrize("key", ["cursor", "step"])
def test_negative_cursor_or_step(tmp_path, capsys, key):
    ckpt, _ = make_checkpoint(tmp_path)
    edit_meta(ckpt, lambda m: m.__setitem__(key, -5))
    assert key in checkpoint_problem(ckpt)
    assert find_latest(str(tmp_path / "run")) is None
    refused(capsys, export_main, [ckpt, str(tmp_path / "x")], "meta.json", key)
    refused(capsys, eval_main, eval_argv(tmp_path, ckpt), "meta.json", key)


def test_doctor_export_warns_on_modified_modeling_file_and_last_layer(tmp_path, capsys):
    from dflash_dist.cli.doctor import main as doctor_main
    ckpt, _ = make_checkpoint(tmp_path)
    out = export_checkpoint(ckpt, str(tmp_path / "e"), tokenizer=False)
    doc = Doctor()
    check_export(doc, out)
    assert [r["status"] for r in doc.rows] == ["PASS"]  # the file this version writes: no warning
    with open(os.path.join(out, "modeling_dflash.py"), "a") as f:
        f.write("\nimport os  # anything: it runs under trust_remote_code\n")
    cfg = json.load(open(os.path.join(out, "config.json")))
    cfg["dflash_config"]["target_layer_ids"] = [1, 3, 5]  # 5: the 6-layer target's last
    cfg["eagle_aux_hidden_state_layer_ids"] = [2, 4, 6]
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    doc = Doctor()
    check_export(doc, out)
    rows = {r["check"]: r for r in doc.rows}
    assert rows["export modeling"]["status"] == "WARN" and "trust_remote_code" in rows["export modeling"]["detail"]
    assert rows["export layers"]["status"] == "WARN" and "never captured" in rows["export layers"]["detail"]
    assert doc.rows[-1]["check"] == "export" and doc.rows[-1]["status"] == "PASS"
    write_huge_header(os.path.join(out, "model.safetensors"))  # the whole doctor: one line, exit 2
    refused(capsys, doctor_main, ["--no-flex", "--export", out], "model.safetensors", "header length")


@pytest.mark.parametrize("name", ["sys:exit", "os:abort"])
@pytest.mark.parametrize("field", ["variant", "loss.objective"])
def test_a_callable_named_in_meta_is_never_called(tmp_path, capsys, caplog, monkeypatch, name, field):
    """A file naming ``sys:exit`` / ``os:abort`` (modules every program has imported) as the variant or objective:
    refused by the tools with one line, skipped by a resume with the reason, never called."""
    from dflash_dist.cli.doctor import main as doctor_main
    called = []
    monkeypatch.setattr(sys, "exit", lambda *a: called.append("sys:exit"))
    monkeypatch.setattr(os, "abort", lambda *a: called.append("os:abort"))
    older, _ = make_checkpoint(tmp_path, step=3)
    good, _ = make_checkpoint(tmp_path, run="good")
    out = export_checkpoint(good, str(tmp_path / "e"), dtype="float32")
    ckpt, _ = make_checkpoint(tmp_path, step=7)
    settings = {"variant": "dflash", "loss": {"objective": "decayed_ce"}}
    settings["variant" if field == "variant" else "loss"] = name if field == "variant" else {"objective": name}
    edit_meta(ckpt, lambda m: m.__setitem__("drafter", settings))
    refused(capsys, export_main, [ckpt, str(tmp_path / "x")], "meta.json", f"drafter.{field}")
    refused(capsys, eval_main, eval_argv(tmp_path, ckpt), "meta.json", f"drafter.{field}")
    assert f"drafter.{field}" in checkpoint_problem(ckpt)
    assert find_latest(str(tmp_path / "run")) == older                  # train.resume=auto takes the older one
    assert f"skipping checkpoint {ckpt}: " in caplog.text and f"drafter.{field}" in caplog.text
    side = json.load(open(os.path.join(out, META_NAME)))
    side["drafter"] = settings
    json.dump(side, open(os.path.join(out, META_NAME), "w"))
    refused(capsys, eval_main, eval_argv(tmp_path, export=out), META_NAME, f"drafter.{field}")
    refused(capsys, doctor_main, ["--no-flex", "--export", out], META_NAME, f"drafter.{field}")
    assert called == []


def test_a_setting_since_retired_in_meta_still_loads_and_an_unknown_one_does_not(tmp_path, capsys):
    # checkpoints of earlier versions record drafter.tuning.compute_weights (removed: it changed no weight)
    ckpt, _ = make_checkpoint(tmp_path)
    edit_meta(ckpt, lambda m: m["job_config"]["drafter"].setdefault("tuning", {}).__setitem__("compute_weights",
                                                                                              "cast"))
    assert checkpoint_problem(ckpt) is None
    assert export_main([ckpt, str(tmp_path / "export")]) == 0
    edit_meta(ckpt, lambda m: m["job_config"]["drafter"]["tuning"].__setitem__("no_such_knob", 1))
    refused(capsys, export_main, [ckpt, str(tmp_path / "export2")], "meta.json",
            "job_config.drafter.tuning.no_such_knob")
