"""Domino end to end on CPU: drafter=tiny_domino trains (1 target + 2 drafters) with its loss falling, evaluates
with the head's decode, and exports what SGLang loads (DominoDraftModel, dflash_config, tensor names), which
dflash-doctor passes, dflash-eval runs, and transformers' AutoModel serves with the project loader's logits."""

import json
import os

import torch
import torch.nn.functional as F
from helpers.launch_util import torchrun
from safetensors import safe_open

from dflash_dist.export.write import export_checkpoint
from dflash_dist.export.load import load_export
from dflash_dist.cli import doctor
from dflash_dist.cli.eval import main as eval_main
from dflash_dist.eval.spec_decode import make_dflash_draft_fn
from dflash_dist.model.variants.domino import head as D
from dflash_dist.model.masks import dense_mask
from dflash_dist.model.variants.domino.variant import DominoDrafter, settings_from_export

STEPS = 16


def _train(run):
    r = torchrun(3, ["-m", "dflash_dist.train", f"train.output_dir={run}", "drafter=tiny_domino",
                     f"train.max_steps={STEPS}", "train.eval_every=0", "train.eval_prompts=2",
                     "train.eval_max_new_tokens=16", "logging.log_every=4", "logging.progress_bar=false",
                     "logging.wandb.mode=disabled"], timeout=500)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
    return rows, run / "checkpoints" / sorted(os.listdir(run / "checkpoints"))[-1]


def _check_export_files(exp, ck_cfg):
    cfg = json.load(open(os.path.join(exp, "config.json")))
    assert cfg["architectures"] == ["DominoDraftModel"]
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DominoDraftModel"}
    s = D.DominoSettings(**ck_cfg["variant_settings"])
    dfc = cfg["dflash_config"]
    assert {k: dfc[k] for k in ("projector_type", "emb_dim", "gru_hidden_dim", "pure_draft_prefix_len",
                                "shift_label")} == {"projector_type": "domino", "emb_dim": 32, "gru_hidden_dim": 32,
                                                    "pure_draft_prefix_len": 1, "shift_label": False}
    assert cfg["emb_dim"] == 32 and "target_layer_ids" in dfc and dfc["block_size"] == 16
    want = D.expected_shapes(cfg["hidden_size"], cfg["vocab_size"], s)
    with safe_open(os.path.join(exp, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert {k: tuple(f.get_slice(k).get_shape()) for k in want} == want
    assert not any(k.startswith("domino.") for k in keys) and "fc.weight" in keys
    return cfg


def _automodel_matches_loader(exp, cfg):
    """Corrected logits of one block from AutoModel(trust_remote_code) and from load_export are the same."""
    from transformers import AutoModel
    ours, _ = load_export(exp)
    assert isinstance(ours, DominoDrafter)
    hf = AutoModel.from_pretrained(exp, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(hf).__name__ == "DominoDraftModel"
    g = torch.Generator().manual_seed(0)
    h, v, bsz = cfg["hidden_size"], cfg["vocab_size"], 16
    n_feat = len(cfg["dflash_config"]["target_layer_ids"])
    embed, head = torch.randn(v, h, generator=g), torch.randn(v, h, generator=g) * 0.2
    ctx_len = 9
    feats = torch.randn(1, ctx_len, n_feat * h, generator=g)
    tokens = torch.randint(0, v, (1, bsz), generator=g)
    block_ids = tokens.clone()
    block_ids[:, 1:] = cfg["dflash_config"]["mask_token_id"]
    blk_pos = torch.arange(ctx_len, ctx_len + bsz)[None]
    with torch.no_grad():
        mask = dense_mask(torch.tensor([[ctx_len]]), torch.tensor([[True]]), ctx_len, bsz)
        hid = ours(F.embedding(block_ids, embed), feats, torch.arange(ctx_len)[None], blk_pos, mask)
        want = ours.domino.corrected_logits(hid @ head.t(), hid, F.embedding(tokens, embed), bsz)
        hid_hf = hf(position_ids=torch.arange(ctx_len + bsz)[None], noise_embedding=F.embedding(block_ids, embed),
                    target_hidden=feats)
        lm_head = torch.nn.Linear(h, v, bias=False)
        lm_head.weight.copy_(head)
        got = hf.compute_logits(hid_hf, lm_head, F.embedding(tokens, embed))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(want, hid @ head.t(), atol=1e-3)    # the correction is in the logits compared
    # evaluation's draft step (what the in-training evaluation and dflash-eval run) is the head's greedy decode
    draft = make_dflash_draft_fn(ours, embed, head)
    proposals, _ = D.propose(ours.domino, hid, block_ids[:, 0], head, embed)
    assert torch.equal(draft(feats, block_ids, ctx_len), proposals[0])


def test_tiny_domino_trains_evaluates_and_exports(tmp_path):
    rows, ck = _train(tmp_path / "run")
    train = [x for x in rows if "loss" in x and "acc" in x]
    assert train[-1]["step"] == STEPS and all("loss_domino" in x for x in train)
    assert train[-1]["loss"] < 0.9 * train[0]["loss"], [round(x["loss"], 3) for x in train]
    evals = [x for x in rows if x.get("kind") == "eval"]
    assert evals and evals[-1]["step"] == STEPS and evals[-1]["acceptance_length"] >= 1.0, evals
    # the train side of the train/serve gap is the corrected proposals' accuracy, logged per slot
    assert all(0.0 <= x["served_acc"] <= 1.0 and "served_acc_slot_15" in x for x in train)
    assert evals[-1]["train_acc"] == train[-1]["served_acc"]
    assert evals[-1]["tau_from_train_acc"] == train[-1]["tau_from_served_acc"]
    meta = json.load(open(ck / "meta.json"))
    assert meta["drafter"]["variant"] == "domino" and meta["drafter_config"]["variant_settings"]["emb_dim"] == 32

    exp = export_checkpoint(str(ck), str(tmp_path / "export"), dtype="float32")
    cfg = _check_export_files(exp, meta["drafter_config"])
    assert settings_from_export(cfg).gru_hidden_dim == 32
    doc = doctor.Doctor()
    doctor.check_export(doc, exp)
    assert doc.rows[-1]["status"] == "PASS", doc.rows[-1]
    _automodel_matches_loader(exp, cfg)

    # dflash-eval of the checkpoint and of its export: the same acceptance lengths (the export decodes the same)
    common = ["--num-prompts", "2", "--max-new-tokens", "12"]
    assert eval_main(["--checkpoint", str(ck), *common, "--out", str(tmp_path / "c.json")]) == 0
    assert eval_main(["--export", exp, *common, "--out", str(tmp_path / "e.json")]) == 0
    c, e = json.load(open(tmp_path / "c.json")), json.load(open(tmp_path / "e.json"))
    assert e["n_prompts"] == 2 and e["lossless_fraction"] == 1.0
    assert [r["acceptance_lengths"] for r in e["per_prompt"]] == [r["acceptance_lengths"] for r in c["per_prompt"]]


def test_tiny_domino_trains_by_epochs(tmp_path):
    """With train.max_steps=-1 (the default: train.epochs) the curriculum decays lambda over the steps the plan of
    the epochs comes to: the run trains to its end (it stopped at the first step when it read train.max_steps).
    With D-PACE weights, which the Domino term takes from the group's loss (tests/unit/model/test_variant_domino)."""
    run = tmp_path / "run"
    r = torchrun(2, ["-m", "dflash_dist.train", f"train.output_dir={run}", "drafter=tiny_domino", "train.epochs=1",
                     "drafter.loss.weighting=dpace", "data.source=synthetic:40:64", "train.eval_prompts=0",
                     "logging.log_every=1", "logging.progress_bar=false", "logging.wandb.mode=disabled"], timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
    train = [x for x in rows if "loss_domino" in x]
    done = [x for x in rows if x.get("kind") == "accounting"][-1]
    assert done["samples_trained"] == 64 and train[-1]["step"] == done["step"] > 1, (train[-1:], done)
    assert all(0.0 < x["dpace_q"] <= 1.0 and "dpace_weight_slot_15" in x for x in train), train[-1]
