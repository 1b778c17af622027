"""D-PACE and KL with drafter.tuning.loss_on_target: CPU jobs on the tiny default (1 target + 1 drafter, 6 steps,
anchors in 2 groups) train the same weights as the same job with the loss on the drafter. The served loss runs the
objective's own function on the same rows (tests/unit/model/test_served_objectives.py), so on CPU the weights are
bit for bit the local run's; D-PACE's weight sum comes with the target's reply (taken from the rows' slot weights
instead, the update moves: Adam hides most of a per-step scale, so only equality sees it)."""

import json
import os

import torch
from helpers.launch_util import torchrun
from safetensors.torch import load_file


def _job(run, *overrides):
    r = torchrun(2, ["-m", "dflash_dist.train", f"train.output_dir={run}", "train.max_steps=6", "train.eval_prompts=0",
                     "logging.log_every=3", "logging.progress_bar=false", "logging.wandb.mode=disabled",
                     "drafter.tuning.micro_batches=2", *overrides], timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    ck = sorted(os.listdir(os.path.join(run, "checkpoints")))[-1]
    with open(os.path.join(run, "metrics.jsonl")) as f:
        train = [x for x in map(json.loads, f) if x["kind"] == "train"]
    return load_file(os.path.join(run, "checkpoints", ck, "model.safetensors")), train, out


def _same_training(tmp_path, name, objective, served):
    local, rec_local, _ = _job(tmp_path / f"{name}_local", *objective)
    offload, rec_off, out = _job(tmp_path / f"{name}_offload", *objective, "drafter.tuning.loss_on_target=true", *served)
    assert "head requests served" in out and "lm_head and loss of the drafters' steps run here" in out, out[-3000:]
    assert local.keys() == offload.keys() and local
    assert [k for k in local if not torch.equal(local[k], offload[k])] == []
    assert rec_off[-1]["step"] == rec_local[-1]["step"] == 6
    for key in ("loss", "acc"):
        assert abs(rec_off[-1][key] - rec_local[-1][key]) <= 1e-5 * max(1.0, abs(rec_local[-1][key])), key
    return rec_off, out


def test_dpace_on_the_target_trains_the_weights_of_the_local_loss(tmp_path):
    rec, out = _same_training(tmp_path, "dpace", ["drafter.loss.weighting=dpace"], [])
    assert "12 head requests served" in out, out[-3000:]  # 6 steps x 2 groups, every group served
    assert 0 < rec[-1]["dpace_q"] < 1 and rec[-1]["dpace_weight_slot_1"] > rec[-1]["dpace_weight_slot_15"]


def test_kl_on_the_target_trains_the_weights_of_the_local_loss(tmp_path):
    kl = ["drafter.loss.labels=target", "drafter.loss.kind=kl", "drafter.loss.kl_top_k=8"]
    _, out = _same_training(tmp_path, "kl", kl, ["drafter.tuning.local_loss_groups=1"])
    assert "6 head requests served" in out, out[-3000:]  # one group of each step served, the other local
