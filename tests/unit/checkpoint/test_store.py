"""Checkpoint files are data, never code: the optimizer state loads under torch.load(weights_only=True), a pickle
that names a callable is refused before it runs, and export / evaluation never open optimizer.pt."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from tests.unit.export.test_export import make_checkpoint

from dflash_dist.checkpoint.store import (
    CheckpointError,
    checkpoint_problem,
    find_latest,
    load_checkpoint,
    save_checkpoint,
)
from dflash_dist.config import TrainConfig
from dflash_dist.roles.drafter_rank.trainer import cosine_lr


class _RunsCode:
    """Unpickling this runs exec(...), which writes the marker file: what a hostile optimizer.pt could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('unpickled')",)


def poison_optimizer(ckpt: str, marker) -> None:
    """Replace the checkpoint's optimizer.pt with a pickle that runs code, and record its size in meta.json (so
    the checkpoint looks complete to everything that does not open optimizer.pt)."""
    path = os.path.join(ckpt, "optimizer.pt")
    torch.save({"state": {}, "param_groups": [], "payload": _RunsCode(marker)}, path)
    meta_path = os.path.join(ckpt, "meta.json")
    meta = json.load(open(meta_path))
    meta["files"]["optimizer.pt"] = os.path.getsize(path)
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    assert checkpoint_problem(ckpt, optimizer=False) is None


def test_adamw_state_loads_under_weights_only(tmp_path):
    """What the drafter saves (AdamW's state_dict, lr set by the cosine schedule as the loop does) loads back with
    weights_only=True and resumes identically."""
    tc = TrainConfig()

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        return model, torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=tuple(tc.betas),
                                        weight_decay=tc.weight_decay, fused=False)

    model, opt = make()
    for step in range(3):
        for g in opt.param_groups:
            g["lr"] = tc.lr * cosine_lr(step, 10, 0.1, 0.1)
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    ckpt = save_checkpoint(str(tmp_path), 3, model.state_dict(), opt.state_dict(), {"cursor": 3})
    torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True)  # plain data, nothing else
    weights, state, meta = load_checkpoint(ckpt)
    model2, opt2 = make()
    model2.load_state_dict(weights)
    opt2.load_state_dict(state)
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    for k, v in opt.state_dict()["state"].items():
        for name, t in v.items():
            torch.testing.assert_close(opt2.state_dict()["state"][k][name], t, rtol=0, atol=0)
    x = torch.randn(4, 8)
    for m, o in ((model, opt), (model2, opt2)):
        m(x).square().mean().backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_optimizer_pickle_with_code_is_refused_and_never_runs(tmp_path):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    ckpt = save_checkpoint(str(tmp_path / "run"), 5, model.state_dict(), opt.state_dict(), {"cursor": 5})
    marker = tmp_path / "marker"
    poison_optimizer(ckpt, marker)

    # the payload is live: a weights_only=False load of a copy runs it (what load_checkpoint used to do)
    control = tmp_path / "control.pt"
    shutil.copy(os.path.join(ckpt, "optimizer.pt"), control)
    torch.load(control, weights_only=False)
    assert marker.read_text() == "unpickled"
    marker.unlink()

    # resume=auto skips it (checkpoint_problem opens optimizer.pt under weights_only), naming why
    assert "refusing to load optimizer.pt" in checkpoint_problem(ckpt)
    assert find_latest(str(tmp_path / "run")) is None
    assert not marker.exists()
    with pytest.raises(CheckpointError, match=r"refusing to load optimizer\.pt.*weights_only=True"):
        load_checkpoint(ckpt)  # what DrafterTrainer calls on resume
    assert not marker.exists()
    with pytest.raises(ValueError):  # CheckpointError is a ValueError (callers catching that keep working)
        load_checkpoint(ckpt)
    weights, opt_state, _ = load_checkpoint(ckpt, optimizer=False)
    assert opt_state is None and set(weights) == {"weight", "bias"}
    assert not marker.exists()


def test_export_and_eval_never_open_the_optimizer_file(tmp_path, monkeypatch):
    """dflash-export and dflash-eval --checkpoint of a checkpoint whose optimizer.pt would run code: both work, and
    neither opens that file (torch.load is watched; the payload's marker never appears)."""
    from dflash_dist.export.write import export_checkpoint
    from dflash_dist.export.load import load_export
    from dflash_dist.cli.eval import main as eval_main
    ckpt, model = make_checkpoint(tmp_path)
    marker = tmp_path / "marker"
    poison_optimizer(ckpt, marker)
    real_load = torch.load
    opened = []

    def watched_load(f, *a, **k):
        if "optimizer" in str(f):
            opened.append(str(f))
        return real_load(f, *a, **k)

    monkeypatch.setattr(torch, "load", watched_load)
    out = export_checkpoint(ckpt, str(tmp_path / "export"), dtype="float32")
    exported, _ = load_export(out)
    for name, t in exported.state_dict().items():
        torch.testing.assert_close(t, model.state_dict()[name], rtol=0, atol=0)
    rows = tmp_path / "p.jsonl"
    rows.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    res = tmp_path / "eval.json"
    assert eval_main(["--checkpoint", ckpt, "--prompts", str(rows), "--max-new-tokens", "4", "--out", str(res)]) == 0
    assert json.load(open(res))["n_prompts"] == 1
    assert opened == [] and not marker.exists()


_SAVE_UNDER_LIMIT = r"""
import resource, sys, torch
from dflash_dist.checkpoint.store import CheckpointSaveError, save_checkpoint
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
model = {"w": torch.ones(200_000)}                   # 800 kB: under the limit
opt = {"state": {0: {"m": torch.ones(400_000)}}, "param_groups": []}  # 1.6 MB: past it (torch.save's file)
try:
    save_checkpoint(sys.argv[1], 4, model, opt, {"cursor": 4, "total_messages": 10})
except CheckpointSaveError as e:
    print("ERR", e.errno, e.needed, e)
"""


def test_a_save_past_the_file_size_limit_names_path_errno_and_bytes_and_keeps_the_previous(tmp_path):
    """A write past ``ulimit -f`` (EFBIG: Python ignores SIGXFSZ) inside torch.save, which wraps it in a
    RuntimeError without errno: the error names the checkpoint, errno 27 and the bytes it needs; no temporary
    directory stays; the previous checkpoint is the newest complete one still."""
    good = save_checkpoint(str(tmp_path), 2, {"w": torch.ones(4)}, None, {"cursor": 2, "total_messages": 10})
    r = subprocess.run([sys.executable, "-c", _SAVE_UNDER_LIMIT, str(tmp_path), str(1_200_000)],
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.startswith("ERR 27 "), r.stdout + r.stderr
    assert os.path.join(str(tmp_path), "checkpoints", "step_00000004") in r.stdout
    needed = int(r.stdout.split()[2])
    assert needed >= 2_400_000 and f"about {needed} bytes" in r.stdout and "EFBIG" in r.stdout
    assert "ulimit -f" in r.stdout and "bytes free there" in r.stdout
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000002"]  # no .tmp_step_* left
    assert find_latest(str(tmp_path)) == good


def test_a_weights_file_past_the_limit_is_a_save_error_not_safetensors_own(tmp_path):
    """safetensors' writer raises its own SafetensorError (not an OSError nor a RuntimeError) when the weights file
    crosses the limit: still one CheckpointSaveError naming errno 27, and no temporary directory left."""
    script = _SAVE_UNDER_LIMIT.replace('model = {"w": torch.ones(200_000)}', 'model = {"w": torch.ones(600_000)}')
    assert script != _SAVE_UNDER_LIMIT  # 2.4 MB of weights: model.safetensors itself crosses the limit
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path), str(1_200_000)],
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.startswith("ERR 27 "), r.stdout + r.stderr
    assert "EFBIG" in r.stdout and os.listdir(tmp_path / "checkpoints") == []


def test_a_full_disk_says_what_to_free(tmp_path, monkeypatch):
    """ENOSPC from the weights' writer (safetensors names the errno only in its message)."""
    import errno

    import safetensors.torch

    from dflash_dist.checkpoint import store

    def full(*a, **k):
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(store.CheckpointSaveError) as e:
        save_checkpoint(str(tmp_path), 3, {"w": torch.ones(1000)}, None, {"cursor": 3, "total_messages": 10})
    assert e.value.errno == errno.ENOSPC and "the disk is full" in str(e.value)
    assert e.value.fix.startswith(f"free at least {e.value.needed} bytes on the disk of {tmp_path}")
    assert os.listdir(tmp_path / "checkpoints") == []


def test_space_is_compared_before_a_save_and_stale_temporaries_are_removed(tmp_path, monkeypatch):
    from collections import namedtuple

    from dflash_dist.checkpoint import store
    assert store.space_problem(str(tmp_path), 1000) is None
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(store.shutil, "disk_usage", lambda p: usage(10_000, 9_000, 1_000))
    assert "1000 bytes free" in store.space_problem(str(tmp_path), 5_000)
    os.makedirs(tmp_path / "checkpoints" / ".tmp_step_00000004_123")
    assert store.remove_stale_tmp(str(tmp_path)) == [str(tmp_path / "checkpoints" / ".tmp_step_00000004_123")]
    assert os.listdir(tmp_path / "checkpoints") == []


def test_resume_auto_skips_a_checkpoint_whose_meta_is_not_an_object(tmp_path, caplog):
    import logging
    good = save_checkpoint(str(tmp_path), 2, {"w": torch.ones(4)}, None, {"cursor": 2, "total_messages": 10})
    bad = save_checkpoint(str(tmp_path), 4, {"w": torch.ones(4)}, None, {"cursor": 4, "total_messages": 10})
    with open(os.path.join(bad, "meta.json"), "w") as f:
        json.dump([1], f)
    with caplog.at_level(logging.WARNING):
        assert find_latest(str(tmp_path)) == good
    assert f"skipping checkpoint {bad}: meta.json holds a list, not a JSON object" in caplog.text
