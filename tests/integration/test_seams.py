"""A drafter variant and an objective registered from test code alone (tests/helpers/toy_seams.py) each train in a
real job of their own, beside the other seam's default: drafter.variant / drafter.loss.objective name them as
module:Class, every rank imports them, and the trainer, the statistics, the checkpoint and the export take what
they declare."""

import json
import os

import torch
from helpers.launch_util import REPO, torchrun
from safetensors import safe_open
from safetensors.torch import load_file

from dflash_dist.export.write import export_checkpoint

TOY_DIR = os.path.join(REPO, "tests")
VARIANT, OBJECTIVE = "helpers.toy_seams:ScaledDFlash", "helpers.toy_seams:UniformCE"


def _train(run, overrides: list) -> tuple[list, str, dict]:
    """A 10-step job on 2 CPU ranks, no evaluation: (its training records, its last checkpoint, that meta.json)."""
    r = torchrun(2, ["-m", "dflash_dist.train", f"train.output_dir={run}", "train.max_steps=10",
                     "train.eval_prompts=0", "logging.log_every=5", "logging.progress_bar=false",
                     "logging.wandb.mode=disabled"] + overrides,
                 timeout=400, env={"PYTHONPATH": REPO + os.pathsep + TOY_DIR})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
    train = [x for x in rows if "loss" in x and "acc" in x]
    assert train[-1]["step"] == 10 and train[-1]["loss"] < train[0]["loss"]
    ck = run / "checkpoints" / sorted(os.listdir(run / "checkpoints"))[-1]
    return train, ck, json.load(open(ck / "meta.json"))


def test_toy_variant_trains_checkpoints_and_exports(tmp_path, monkeypatch):
    """The toy variant with the default objective: its loss term is logged, its weight trains, the checkpoint
    records it and the export writes its fields and tensor names."""
    monkeypatch.syspath_prepend(TOY_DIR)  # this process reads the checkpoint too (export)
    train, ck, meta = _train(tmp_path / "run", [f"drafter.variant={VARIANT}"])
    # the variant's loss term, a named statistic; its weight moved away from 1 by training
    assert all("loss_scale_l2" in x for x in train) and train[-1]["loss_scale_l2"] > 0
    assert not any("mean_row_weight" in x for x in train)  # the default objective: not the toy one
    assert meta["drafter"]["variant"] == VARIANT and meta["drafter"]["loss"]["objective"] == "decayed_ce"
    assert "block_size" not in meta and meta["drafter_config"]["block_size"] == 16
    assert VARIANT in meta["identity"]["drafter"]["label"]
    scale = load_file(ck / "model.safetensors")["out_scale"]
    assert not torch.equal(scale, torch.ones_like(scale))
    import helpers.toy_seams  # noqa: F401  (a file never imports the code it names: the program does)
    exp = export_checkpoint(str(ck), str(tmp_path / "export"), dtype="float32", tokenizer=False)
    cfg = json.load(open(os.path.join(exp, "config.json")))
    assert cfg["architectures"] == ["ScaledDFlashDraftModel"] and cfg["dflash_config"]["output_scale"] is True
    with safe_open(os.path.join(exp, "model.safetensors"), "pt") as f:
        assert "output_scale.weight" in f.keys() and "out_scale" not in f.keys()
        assert torch.equal(f.get_tensor("output_scale.weight"), scale)


def test_toy_objective_trains_and_checkpoints(tmp_path):
    """The toy objective with the default variant: its own metric says every supervised row weighs 1 (decayed
    CE's mean weight is below 1), and the checkpoint records it beside the default variant."""
    train, ck, meta = _train(tmp_path / "run", [f"drafter.loss.objective={OBJECTIVE}"])
    assert all(x["mean_row_weight"] == 1.0 for x in train)
    assert not any("loss_scale_l2" in x for x in train)  # the default variant: no loss term of its own
    assert meta["drafter"]["variant"] == "dflash" and meta["drafter"]["loss"]["objective"] == OBJECTIVE
    assert OBJECTIVE in meta["identity"]["drafter"]["label"]
    assert "out_scale" not in load_file(ck / "model.safetensors")
