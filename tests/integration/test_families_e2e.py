"""Every target family people train DFlash drafters for, end to end on CPU (torchrun, gloo, 1 target + 1 drafter):
tiny random-init configs of conf/target/, a few steps, the export reloads with identical logits, and the RoPE the
export writes is the family's. A family the drafter cannot mirror is refused before any weights load."""

import json
import os

import pytest
import torch
import yaml
from helpers.launch_util import REPO, torchrun

# family -> (conf/target name, rope_type exported, what the fast-path line must say)
FAMILIES = {
    "llama3": ("tiny_llama3", "llama3", ["attention: sdpa", "MoE experts: none"]),
    "mistral": ("tiny_mistral", "default", ["attention: sdpa", "MoE experts: none"]),
    "gpt_oss": ("tiny_gpt_oss", "yarn", ["attention: eager", "MoE experts: grouped_mm (GptOssExperts x8"]),
    "qwen3_moe": ("tiny_qwen3_moe", "default", ["attention: sdpa", "MoE experts: grouped_mm (Qwen3MoeExperts x8"]),
    "qwen3_5": ("tiny_qwen3_5", "default", ["Qwen3_5GatedDeltaNet x6", "MoE experts: none"]),
    "qwen3_5_moe": ("tiny_qwen3_5_moe", "default", ["Qwen3_5MoeGatedDeltaNet x6",
                                                    "MoE experts: grouped_mm (Qwen3_5MoeExperts x8"]),
    "qwen3_next": ("tiny_hybrid", "default", ["Qwen3NextGatedDeltaNet x6", "MoE experts: none"]),  # mlp_only
}
STEPS = 3


def _drafter_logits(model, lm_head, hidden, n_feat, seed=1):
    from dflash_dist.model.masks import dense_mask
    g = torch.Generator().manual_seed(seed)
    ctx, block = 9, model.config.block_size
    feats = torch.randn(1, ctx, n_feat * hidden, generator=g)
    embeds = torch.randn(1, block, hidden, generator=g)
    mask = dense_mask(torch.tensor([[ctx]]), torch.tensor([[True]]), ctx, block)
    with torch.no_grad():
        h = model(embeds, feats, torch.arange(ctx)[None], torch.arange(ctx, ctx + block)[None], mask)
    return h @ lm_head.T


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_trains_exports_reloads(family, tmp_path):
    from safetensors.torch import load_file

    from dflash_dist.export.write import export_checkpoint
    from dflash_dist.export.load import load_export
    from dflash_dist.config import TargetConfig
    from dflash_dist.model.drafter import DFlashDrafter, DrafterModelConfig
    from dflash_dist.targets.hf import build_target_model

    conf, rope_type, says = FAMILIES[family]
    r = torchrun(2, ["-m", "dflash_dist.train", f"train.output_dir={tmp_path}", f"target={conf}", "drafter=tiny",
                     f"train.max_steps={STEPS}", "train.eval_prompts=0", "logging.log_every=1",
                     "logging.progress_bar=false", "logging.wandb.mode=disabled"], timeout=420)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    # the last one: the built model's (the first is the config-only check before weights load)
    line = [x for x in out.splitlines() if "[rank 1 target]" in x and "target fast path:" in x][-1]
    for s in says:
        assert s in line, line
    assert f"drafter RoPE: {rope_type}" in out
    recs = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [x for x in recs if x["kind"] == "train"][-1]["step"] == STEPS
    acc = [x for x in recs if x["kind"] == "accounting"][-1]
    assert acc["samples_trained"] > 0 and acc["samples_sent"] == acc["samples_received"]

    ckpt = tmp_path / "checkpoints" / f"step_{STEPS:08d}"
    export = export_checkpoint(str(ckpt), str(tmp_path.parent / f"{tmp_path.name}-export"), dtype="float32")
    cfg = json.load(open(os.path.join(export, "config.json")))
    assert cfg["rope_parameters"]["rope_type"] == rope_type
    assert "partial_rotary_factor" not in cfg["rope_parameters"] and "mrope_section" not in cfg["rope_parameters"]
    back, meta = load_export(export)
    ck_meta = json.load(open(ckpt / "meta.json"))
    trained = DFlashDrafter(DrafterModelConfig(**ck_meta["drafter_config"]), "sdpa").eval()
    trained.load_state_dict({k.removeprefix("module."): v for k, v in load_file(ckpt / "model.safetensors").items()})
    with open(os.path.join(REPO, "conf", "target", f"{conf}.yaml")) as f:
        d = yaml.safe_load(f)
        d.pop("defaults", None)
        target = build_target_model(TargetConfig(**d), "cpu")
    lm_head = target.get_output_embeddings().weight.float()
    hidden, n_feat = back.config.hidden_size, len(meta["layer_ids"])
    assert torch.equal(_drafter_logits(back, lm_head, hidden, n_feat), _drafter_logits(trained, lm_head, hidden, n_feat))
    assert back.rope.attention_scaling == trained.rope.attention_scaling


def test_unmirrorable_family_refused_before_weights_load(tmp_path):
    """DeepSeek-V3 attention (multi-head latent attention) cannot be mirrored by the drafter: refused by name,
    exit 2, before any rank builds the target."""
    conf = tmp_path / "conf" / "target"
    conf.mkdir(parents=True)
    with open(os.path.join(REPO, "conf", "target", "tiny_llama3.yaml")) as f:
        d = yaml.safe_load(f)
    d.pop("defaults", None)  # a preset: the fields that differ from TargetConfig's defaults
    d["hf_config"] = {"model_type": "deepseek_v3", "vocab_size": 2048, "hidden_size": 64, "num_hidden_layers": 8,
                      "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128,
                      "moe_intermediate_size": 32, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
                      "qk_nope_head_dim": 8, "v_head_dim": 16}
    d = {"defaults": ["base", "_self_"], **d}
    with open(conf / "tiny_deepseek.yaml", "w") as f:
        yaml.safe_dump(d, f)
    r = torchrun(2, ["-m", "dflash_dist.train", f"train.output_dir={tmp_path / 'run'}", "drafter=tiny",
                     f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "target=tiny_deepseek",
                     "train.max_steps=1", "logging.progress_bar=false", "logging.wandb.mode=disabled"], timeout=200)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "deepseek_v3" in out and "multi-head latent attention" in out, out[-3000:]
    assert "target loaded in" not in out


def test_own_shallow_gpt_oss_config_trains_with_the_defaults(tmp_path):
    """A user's own gpt-oss config (``target.hf_config``, 4 layers, no attention setting, no layer ids) trains:
    the attention transformers supports for it is chosen (eager on CPU; sdpa is refused for gpt-oss), and the
    default layer ids of a 4-layer target are distinct and below its last layer."""
    conf = tmp_path / "conf" / "target"
    conf.mkdir(parents=True)
    with open(os.path.join(REPO, "conf", "target", "tiny_gpt_oss.yaml")) as f:
        hf = yaml.safe_load(f)["hf_config"]
    hf.update(num_hidden_layers=4, layer_types=hf["layer_types"][:4])
    with open(conf / "my_gpt_oss.yaml", "w") as f:
        yaml.safe_dump({"defaults": ["base", "_self_"], "hf_config": hf}, f)
    r = torchrun(2, ["-m", "dflash_dist.train", f"train.output_dir={tmp_path / 'run'}", "drafter=tiny",
                     f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "target=my_gpt_oss", "train.max_steps=2",
                     "train.eval_prompts=0", "logging.progress_bar=false", "logging.wandb.mode=disabled"], timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "target layers [0, 1, 2] of 4" in out
    assert "attention: eager (auto: GptOssForCausalLM on cpu supports eager)" in out
    recs = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [x for x in recs if x["kind"] == "train"][-1]["step"] == 2
