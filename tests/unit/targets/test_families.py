"""The target family registry: every preset finds its family, every family has a preset, and each rule a family
holds (refusal, the drafter's MLP width, packing, sliding windows, sinks, linear-attention markers) reads the config
and the built layers as the roles need."""

import dataclasses
import os

import pytest
import yaml
from transformers import DeepseekV3Config, Gemma2Config, GemmaConfig

from dflash_dist.config import ConfigError, TargetConfig
from dflash_dist.targets import families as F
from dflash_dist.model.drafter import DrafterModelConfig
from dflash_dist.targets.hf import build_target_model, load_hf_config

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf", "target")

# preset -> the family its config belongs to
PRESETS = {"tiny": "qwen3", "qwen3_8b_random": "qwen3", "tiny_llama3": "llama", "llama31_8b_random": "llama",
           "tiny_mistral": "mistral", "tiny_qwen3_moe": "qwen3_moe", "tiny_gpt_oss": "gpt_oss",
           "tiny_hybrid": "qwen3_next", "qwen3_next_small": "qwen3_next", "tiny_qwen3_5": "qwen3_5",
           "tiny_qwen3_5_moe": "qwen3_5_moe"}


def _tcfg(name: str) -> TargetConfig:
    with open(os.path.join(CONF, f"{name}.yaml")) as f:
        d = yaml.safe_load(f)
    d.pop("defaults", None)  # a preset: the fields that differ from TargetConfig's defaults
    return TargetConfig(**d)


def _layers(model) -> list:
    return list(model.get_decoder().layers)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_finds_its_family(preset):
    """By the loaded config object (a multimodal wrapper or its text config) and by the preset's dict alike."""
    tcfg = _tcfg(preset)
    hf = load_hf_config(tcfg)
    assert F.family_for(hf).name == PRESETS[preset]
    assert F.family_for(F.text_config(hf)).name == PRESETS[preset]
    if "model_type" in tcfg.hf_config:
        assert F.family_for(dict(tcfg.hf_config)).name == PRESETS[preset]


def test_every_family_has_a_preset_and_every_rule():
    """A new family is an entry plus its tiny preset: an entry no preset reaches fails here, as does an entry
    missing a rule or reusing another's name or model_type."""
    reached = set(PRESETS.values())
    named = [fam for fam in F.REGISTRY if fam.matches is None]
    assert sorted(fam.name for fam in named if fam.name not in reached) == []
    assert len({fam.name for fam in F.REGISTRY}) == len(F.REGISTRY)
    types = [t for fam in named for t in fam.model_types]
    assert len(types) == len(set(types))
    for fam in (*F.REGISTRY, F.DEFAULT):
        assert all(callable(getattr(fam, k)) for k in ("mlp_width", "packing_problem", "sliding_windows",
                                                       "attention_sinks")), fam.name
    assert F.family_for({"model_type": "my_decoder"}) is F.DEFAULT and F.family_for(None) is F.DEFAULT


@pytest.mark.parametrize("config,name,says", [
    (DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=100),
     "latent_attention", "deepseek_v3: multi-head latent attention"),
    ({"model_type": "my_mla", "use_mla": True}, "latent_attention", "my_mla: multi-head latent attention"),
    (Gemma2Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=100, head_dim=16),
     "softcapped", "gemma2: logit softcapping"),
    (GemmaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=100, head_dim=16),
     "gemma", "gemma: scaled input embeddings"),
])
def test_refused_families_by_their_fields(config, name, says):
    fam = F.family_for(config)
    assert fam.name == name and fam.drafter_refusal(config).startswith(says)
    with pytest.raises(ConfigError, match=f"cannot be mirrored by the DFlash drafter: {says}"):
        DrafterModelConfig.from_target(config, num_layers=1, num_feature_layers=2, block_size=4)


def test_mirrorable_families_have_no_refusal():
    for preset in PRESETS:
        hf = load_hf_config(_tcfg(preset))
        assert F.family_for(hf).drafter_refusal(hf) is None, preset


def test_drafter_mlp_width_per_family():
    """Dense and gpt-oss: intermediate_size; Qwen3.5-MoE (none): top-k experts plus the shared expert; a dense
    family without one is refused naming drafter.intermediate_size, MoE fields or not."""
    widths = {p: F.family_for(hf).drafter_intermediate(hf) for p in ("tiny", "tiny_gpt_oss", "tiny_qwen3_5_moe")
              for hf in [F.text_config(load_hf_config(_tcfg(p)))]}
    assert widths == {"tiny": 384, "tiny_gpt_oss": 64, "tiny_qwen3_5_moe": 32 * 2 + 32}
    moe_fields = {"moe_intermediate_size": 32, "num_experts_per_tok": 2}
    assert F.family_for({"model_type": "qwen3_moe", **moe_fields}).drafter_intermediate(moe_fields) == 64
    for cfg in ({"model_type": "llama"}, {"model_type": "my_decoder", **moe_fields}):
        with pytest.raises(ConfigError, match="set drafter.intermediate_size"):
            F.family_for(cfg).drafter_intermediate(cfg)


def test_config_packing_rule_refuses_linear_attention_in_any_family():
    """Before weights load only layer_types are known: a hybrid is refused by its GatedDeltaNet layer, and so is
    a decoder no entry names."""
    hybrid = load_hf_config(_tcfg("tiny_qwen3_5"))
    assert "decoder layer 0 is linear_attention (GatedDeltaNet)" in F.family_for(hybrid).packing_problem(
        F.text_config(hybrid), None)
    mine = {"model_type": "my_decoder", "layer_types": ["full_attention", "linear_attention"]}
    assert F.family_for(mine).packing_problem(mine, None).startswith("decoder layer 1 is linear_attention")
    mistral = load_hf_config(_tcfg("tiny_mistral"))
    assert F.family_for(mistral).packing_problem(mistral, None) is None


def test_config_sliding_window_rule():
    """Mistral's config window counts unless use_sliding_window is false or no layer type slides."""
    rule = F.DEFAULT.sliding_windows
    assert rule({"sliding_window": 8}, None) == (8,)
    assert rule({"sliding_window": 8, "use_sliding_window": False}, None) == ()
    assert rule({"sliding_window": 8, "layer_types": ["full_attention"]}, None) == ()
    assert rule({"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}, None) == (8,)


def test_built_layers_sinks_windows_and_packing():
    """gpt-oss: per-layer windows and sink logits read off its layers; Llama: neither; a hybrid's built layers are
    refused packing by their linear attention."""
    gpt, llama, hybrid = (build_target_model(_tcfg(p), "cpu") for p in ("tiny_gpt_oss", "tiny_llama3", "tiny_hybrid"))
    fam = F.family_for(gpt.config)
    assert fam.name == "gpt_oss"
    assert fam.attention_sinks(_layers(gpt)) is True
    assert fam.sliding_windows(F.text_config(gpt.config), _layers(gpt)) == (16,)
    assert fam.packing_problem(F.text_config(gpt.config), _layers(gpt)) is None
    fam = F.family_for(llama.config)
    assert fam.attention_sinks(_layers(llama)) is False
    assert fam.sliding_windows(F.text_config(llama.config), _layers(llama)) == ()
    fam = F.family_for(hybrid.config)
    assert "has linear attention (GatedDeltaNet)" in fam.packing_problem(F.text_config(hybrid.config), _layers(hybrid))
    assert fam.linear_layer_markers == ("GatedDeltaNet",)
    assert "GatedDeltaNet" in F.linear_layer_markers()


def test_text_config_of_wrappers_objects_and_dicts():
    q35 = load_hf_config(_tcfg("tiny_qwen3_5"))
    assert F.text_config(q35) is q35.text_config and F.model_type(q35) == "qwen3_5_text"
    assert F.text_config({"model_type": "w", "text_config": {"hidden_size": 8}}) == {"hidden_size": 8}
    plain = {"model_type": "llama", "hidden_size": 8}
    assert F.text_config(plain) is plain


def test_an_entry_overrides_one_rule():
    """A family entry is the default rules with some replaced: the registry asks the entry, not the default."""
    fam = dataclasses.replace(F.DEFAULT, name="wide", model_types=("wide",), mlp_width=lambda tc: 7)
    assert fam.drafter_intermediate({"intermediate_size": 3}) == 7
    assert F.DEFAULT.drafter_intermediate({"intermediate_size": 3}) == 3
