"""checkpoint/safe_io: every file read from a checkpoint, export or run directory is a regular file of bounded size
(a FIFO is refused, never opened: it would block the reader; /dev/zero would fill memory), and no file makes a
reader build a model larger than this machine's memory."""

import json
import os
import shutil
import signal

import pytest
from tests.unit.export.test_export import make_checkpoint
from test_hostile import edit_meta, eval_argv, refused

from dflash_dist.export.write import export_checkpoint
from dflash_dist.checkpoint.identity import read_run_json
from dflash_dist.checkpoint.store import checkpoint_problem, find_latest
from dflash_dist.cli import report
from dflash_dist.cli.doctor import main as doctor_main
from dflash_dist.cli.eval import main as eval_main
from dflash_dist.cli.export import main as export_main
from dflash_dist.targets.hf import TINY_DIR


@pytest.fixture(autouse=True)
def deadline():
    """A read that blocks (a FIFO opened) fails the test after 20 s instead of hanging it."""
    def expire(*_):
        raise TimeoutError("a read blocked")
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def fifo_in_place_of(path: str) -> None:
    os.remove(path)
    os.mkfifo(path)


def test_a_fifo_in_a_checkpoint_is_refused_unopened(tmp_path, capsys, caplog):
    older, _ = make_checkpoint(tmp_path, step=3)
    ckpt, _ = make_checkpoint(tmp_path, step=7)
    fifo_in_place_of(os.path.join(ckpt, "meta.json"))
    assert "not a regular file" in checkpoint_problem(ckpt)
    assert find_latest(str(tmp_path / "run")) == older and "not a regular file" in caplog.text   # resume skips it
    refused(capsys, export_main, [ckpt, str(tmp_path / "x")], "meta.json", "not a regular file")
    refused(capsys, eval_main, eval_argv(tmp_path, ckpt), "meta.json", "not a regular file")
    other, _ = make_checkpoint(tmp_path, run="other")
    fifo_in_place_of(os.path.join(other, "model.safetensors"))
    refused(capsys, export_main, [other, str(tmp_path / "x")], "model.safetensors", "not a regular file")
    os.remove(os.path.join(other, "model.safetensors"))
    os.symlink("meta.json", os.path.join(other, "model.safetensors"))   # a link inside is read where it points
    refused(capsys, export_main, [other, str(tmp_path / "x")], "model.safetensors", "bytes, expected")


def test_a_fifo_or_dev_zero_in_an_export_or_run_directory_is_refused(tmp_path, capsys):
    good, _ = make_checkpoint(tmp_path)
    out = export_checkpoint(good, str(tmp_path / "e"), dtype="float32")
    fifo_in_place_of(os.path.join(out, "tokenizer_config.json"))
    refused(capsys, eval_main, eval_argv(tmp_path, export=out), "tokenizer_config.json", "not a regular file")
    refused(capsys, doctor_main, ["--no-flex", "--export", out], "tokenizer_config.json", "not a regular file")
    run = tmp_path / "run"
    os.mkfifo(run / "run.json")
    assert read_run_json(str(run)) is None
    os.mkfifo(run / "metrics.jsonl")
    assert report.main([str(run)]) == 2 and "not a regular file" in capsys.readouterr().err
    # a tokenizer named by the checkpoint: a local directory whose tokenizer.json is /dev/zero
    tok = tmp_path / "tok"
    shutil.copytree(TINY_DIR, tok, ignore=shutil.ignore_patterns("*.safetensors", "*.jsonl"))
    os.remove(tok / "tokenizer.json")
    os.symlink("/dev/zero", tok / "tokenizer.json")
    edit_meta(good, lambda m: m.__setitem__("tokenizer", str(tok)))
    refused(capsys, export_main, [good, str(tmp_path / "y")], "tokenizer.json", "not a regular file")
    os.remove(run / "run.json")
    os.symlink("/dev/zero", run / "run.json")
    assert read_run_json(str(run)) is None


def test_a_model_larger_than_the_machine_is_refused_before_it_is_built(tmp_path, capsys):
    """Each size within its bound, their product not: 1024 layers x intermediate 2^19 (x 2^14 experts)."""
    ckpt, _ = make_checkpoint(tmp_path)
    edit_meta(ckpt, lambda m: m["job_config"]["target"]["hf_config"].update(
        num_hidden_layers=1024, intermediate_size=1 << 19, num_experts=1 << 14, moe_intermediate_size=1 << 19))
    line = refused(capsys, export_main, [ckpt, str(tmp_path / "x")], "meta.json", "job_config.target.hf_config")
    assert "more than this machine's" in line and "1024 layers" in line
    good, _ = make_checkpoint(tmp_path, run="good")
    out = export_checkpoint(good, str(tmp_path / "e"), dtype="float32", tokenizer=False)
    cfg = json.load(open(os.path.join(out, "config.json")))
    cfg.update(num_hidden_layers=1024, intermediate_size=1 << 19, hidden_size=1 << 16)
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    refused(capsys, doctor_main, ["--no-flex", "--export", out], "config.json", "more than this machine's")
