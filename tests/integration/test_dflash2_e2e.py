"""DFlash2 trains in a real job (1 target + 2 drafters, CPU, gloo): the loss and the selector loss fall, the
variant's statistics and the in-training tau (the selector's walk) are logged, the checkpoint records the
settings; the export of the final checkpoint, under dflash-eval on the same held-out prompts, reproduces the
in-training evaluation's acceptance; a DFlash checkpoint is never resumed as DFlash2."""

import glob
import json
import os

import pytest
from helpers.launch_util import torchrun

from dflash_dist.export.write import export_checkpoint
from dflash_dist.cli.eval import main as eval_main

QUICK = ["-m", "dflash_dist.train", "logging.progress_bar=false", "logging.wandb.mode=disabled"]


def test_dflash2_trains_logs_its_statistics_and_refuses_a_dflash_checkpoint(tmp_path):
    run = tmp_path / "d2"
    r = torchrun(3, QUICK + [f"train.output_dir={run}", "drafter=tiny_dflash2", "train.max_steps=30",
                             "train.eval_every=30", "train.eval_prompts=2", "logging.log_every=10",
                             f"data.cache_dir={run / 'data_cache'}"], timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
    train = [x for x in rows if x.get("kind") == "train"]
    assert train[-1]["step"] == 30
    first, last = train[0], train[-1]
    assert last["loss"] < 0.7 * first["loss"]
    # the selector's mean CE over its supervised rows (the default selector_gold=replace_last scores every
    # labelled row, a gold token outside the top-K by its own low unary logit: high at first, falling as the gold
    # tokens enter the top-K)
    assert last["selector_ce"] < 0.8 * first["selector_ce"] and last["loss_selector"] > 0
    assert last["gold_in_topk"] > first["gold_in_topk"] and last["acc_selected"] > 0
    assert {"acc_unary_slot_1", "acc_selected_slot_7", "tau_selector"} <= set(last)
    (ev,) = [x for x in rows if x.get("kind") == "eval"]
    assert ev["step"] == 30 and ev["acceptance_length"] > 1.0
    ck = run / "checkpoints" / sorted(os.listdir(run / "checkpoints"))[-1]
    meta = json.load(open(ck / "meta.json"))
    assert meta["drafter"]["variant"] == "dflash2"
    assert meta["drafter_config"]["variant_settings"]["selector_top_k"] == 8

    # dflash-eval of the step-30 checkpoint's export on the prompts the in-training evaluation took (the same
    # held-out file, the same spread subset and max new tokens): the selector's greedy walk gives the same acceptance
    assert meta["step"] == 30
    (holdout,) = glob.glob(str(run / "data_cache" / "holdout-*.jsonl"))
    exp = export_checkpoint(str(ck), str(tmp_path / "export"), dtype="float32")
    assert eval_main(["--export", exp, "--prompts", holdout, "--num-prompts", str(ev["n_prompts"]),
                      "--max-new-tokens", str(ev["max_new_tokens"]), "--out", str(tmp_path / "e.json")]) == 0
    e = json.load(open(tmp_path / "e.json"))
    assert e["n_prompts"] == ev["n_prompts"] == 2 and e["lossless_fraction"] == 1.0
    assert e["tau"] == pytest.approx(ev["tau"], abs=1e-9)
    assert e["tau_pooled"] == pytest.approx(ev["tau_pooled"], abs=1e-9)
    assert e["prompts_one_step"] == ev["prompts_one_step"]
    pos = [ev[k] for k in sorted((k for k in ev if k.startswith("accept_pos_")), key=lambda k: int(k.split("_")[-1]))]
    assert pos and e["per_position_acceptance"] == pytest.approx(pos, abs=1e-9)
    assert [r["acceptance_lengths"] for r in e["per_prompt"]] == ev["acceptance_lengths"]

    # a DFlash run's checkpoint, resumed as DFlash2: refused before any model loads, naming the variant
    plain = tmp_path / "dflash"
    r = torchrun(3, QUICK + [f"train.output_dir={plain}", "train.max_steps=2", "train.eval_prompts=0"], timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    r = torchrun(3, QUICK + [f"train.output_dir={plain}", "drafter=tiny_dflash2", "train.resume=auto",
                             "train.max_steps=4", "train.eval_prompts=0"], timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "already holds a run" in out and "dflash2 drafter" in out and "dflash drafter" in out, out[-4000:]
    assert "target loaded" not in out


def test_dflash2_resume_with_other_selector_settings_is_refused_by_name(tmp_path):
    """A DFlash2 run resumed with another selector rank (a weight shape) or another selector gold (no shape at
    all) is refused before any model loads, naming the field and both values; with its own settings it goes on."""
    run = tmp_path / "d2"
    common = QUICK + [f"train.output_dir={run}", "drafter=tiny_dflash2", "train.eval_prompts=0"]
    r = torchrun(3, common + ["train.max_steps=2"], timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    for change, named in (("drafter.dflash2.selector_rank=16", "drafter.dflash2.selector_rank is 32 in the run, "
                                                               "16 in this job"),
                          ("drafter.dflash2.selector_gold=exclude",
                           'drafter.dflash2.selector_gold is "replace_last" in the run, "exclude" in this job')):
        r = torchrun(3, common + ["train.max_steps=4", "train.resume=auto", change], timeout=300)
        out = r.stdout + r.stderr
        assert r.returncode != 0 and named in out, out[-4000:]
        assert "target loaded" not in out
    r = torchrun(3, common + ["train.max_steps=4", "train.resume=auto"], timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "resuming from" in out, out[-4000:]


def test_dflash2_on_a_target_replica_trains_like_one_target_rank(tmp_path):
    """drafter=tiny_dflash2 fed by a replica of 2 ranks (target.tensor_parallel=2) against one target rank on the
    same plan: the same loss and selector CE at every step (the replica's features differ by ~1e-6 relative)."""
    from test_replicas import JOB, LOSS_RTOL
    from test_train_e2e import train_records
    steps, one, rep = 6, tmp_path / "k1", tmp_path / "k2"
    args = JOB + ["drafter=tiny_dflash2", f"train.max_steps={steps}", "logging.debug.trace_target=false"]
    r1 = torchrun(2, args + [f"train.output_dir={one}"], timeout=300)
    assert r1.returncode == 0, (r1.stdout + r1.stderr)[-4000:]
    r2 = torchrun(3, args + [f"train.output_dir={rep}", "topology.target_ranks=2", "target.tensor_parallel=2"],
                  timeout=300)
    out = r2.stdout + r2.stderr
    assert r2.returncode == 0, out[-4000:]
    assert "replica 0 ranks [1, 2], tensor-parallel: this rank holds" in out
    a, b = train_records(one), train_records(rep)
    assert [x["step"] for x in a] == [x["step"] for x in b] == list(range(1, steps + 1))
    for x, y in zip(a, b):
        for key in ("loss", "selector_ce"):
            assert abs(x[key] - y[key]) <= LOSS_RTOL * abs(x[key]), (x["step"], key, x[key], y[key])
    assert b[-1]["loss_selector"] > 0 and "acc_selected_slot_7" in b[-1]
