"""The target's own labels in a job: KL distillation of its top-k distribution on the unregenerated corpus
trains, the checkpoint records the label source and kind, and a resume with the data's labels is refused by name."""

import json
import math
import os

from helpers.launch_util import torchrun

QUICK = ["train.eval_prompts=0", "logging.log_every=3", "logging.progress_bar=false", "logging.wandb.mode=disabled",
         "data.source=builtin_original"]


def test_kl_on_target_labels_trains_and_another_label_source_is_not_resumed(tmp_path):
    run = tmp_path / "run"
    own = ["drafter.loss.labels=target", "drafter.loss.kind=kl", "drafter.loss.kl_top_k=8"]
    r = torchrun(2, ["-m", "dflash_dist.train", f"train.output_dir={run}", "train.max_steps=6"] + QUICK + own,
                 timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    train = [json.loads(x) for x in open(run / "metrics.jsonl")]
    train = [x for x in train if "loss" in x and "acc" in x]
    assert train[-1]["step"] == 6 and all(math.isfinite(x["loss"]) and x["loss"] > 0 for x in train)
    ck = run / "checkpoints" / sorted(os.listdir(run / "checkpoints"))[-1]
    meta = json.load(open(ck / "meta.json"))
    loss = meta["drafter"]["loss"]
    assert (loss["labels"], loss["kind"], loss["kl_top_k"]) == ("target", "kl", 8)
    assert "labels target, loss kl top-8" in meta["identity"]["drafter"]["label"]

    # the same run resumed on the data's labels: refused before any model loads, naming the keys
    r = torchrun(2, ["-m", "dflash_dist.train", f"train.output_dir={run}", "train.max_steps=9",
                     "train.resume=auto"] + QUICK, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "- drafter: " in out and "loss.labels" in out, out[-4000:]
    assert "target loaded" not in out
