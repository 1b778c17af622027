"""A CPU job on the tiny default with D-PACE position weights (drafter.loss.weighting=dpace): it trains, its
window metrics carry D-PACE's statistics, and a resume with the other weighting is refused naming it."""

import json
import os

from helpers.launch_util import torchrun


def _train_records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "train"]


def test_dpace_job_trains_and_resume_with_other_weighting_is_refused(tmp_path):
    common = ["-m", "dflash_dist.train", f"train.output_dir={tmp_path}", "train.eval_prompts=0",
              "logging.log_every=5", "logging.progress_bar=false", "logging.wandb.mode=disabled"]
    r = torchrun(2, common + ["train.max_steps=30", "drafter.loss.weighting=dpace"], timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    recs = _train_records(tmp_path)
    assert recs[-1]["step"] == 30
    assert recs[-1]["loss"] < 0.8 * recs[0]["loss"], [round(x["loss"], 3) for x in recs]
    assert 0 < recs[-1]["dpace_q"] < 1 and recs[-1]["dpace_weight_slot_15"] < recs[-1]["dpace_weight_slot_1"]
    r = torchrun(2, common + ["train.max_steps=35", "train.resume=auto"], timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "loss.weighting" in out, out[-4000:]
