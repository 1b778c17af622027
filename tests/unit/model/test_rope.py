"""The drafter's RoPE is transformers' RoPE for the config the drafter exports, for every rope type.

Reference: transformers' own rotary embedding, built from the exported config.json the way a serving engine
builds it (``Qwen3RotaryEmbedding(Qwen3Config(**config.json))``), and, where the target family has its own
rotary class, that class on the target's config (the drafter's RoPE is the target's)."""

import copy

import pytest
import torch

from dflash_dist.export.write import build_export_config
from dflash_dist.export.load import drafter_config_from_export
from dflash_dist.config import ConfigError
from dflash_dist.model.drafter import DFlashDrafter, DrafterModelConfig, rotary_cos_sin
from dflash_dist.model.rope import (
    DrafterRope,
    check_positions,
    default_rope_parameters,
    drafter_rope_parameters,
    position_limit,
)

H, HEADS, D = 64, 4, 16
BASE = {"hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": 2, "head_dim": D,
        "intermediate_size": 96, "vocab_size": 100, "num_hidden_layers": 8, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6}

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
             "truncate": False, "original_max_position_embeddings": 64},
    "yarn_mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "original_max_position_embeddings": 512},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 256,
                 "short_factor": [1.0 + 0.1 * i for i in range(D // 2)],
                 "long_factor": [2.0 + 0.3 * i for i in range(D // 2)]},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}


def _drafter_for(target: dict) -> DFlashDrafter:
    cfg = DrafterModelConfig.from_target(target, num_layers=1, num_feature_layers=2, block_size=4)
    return DFlashDrafter(cfg, "sdpa")


def _export(drafter: DFlashDrafter, target: dict) -> dict:
    return build_export_config(drafter.config, target, [1, 3], mask_token_id=5, block_size=4)


def _hf_rotary(export_cfg: dict):
    """What a serving engine builds from config.json (transformers Qwen3, as the z-lab DFlashDraftModel)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    cfg = {k: v for k, v in export_cfg.items() if k not in ("architectures", "model_type", "dflash_config")}
    return Qwen3RotaryEmbedding(Qwen3Config(**copy.deepcopy(cfg)))


def _positions(max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    ctx = torch.arange(0, max_pos - 4)[None].repeat(2, 1)
    block = torch.arange(max_pos - 4, max_pos)[None].repeat(2, 1)
    return ctx, block


def _check(drafter: DFlashDrafter, export_cfg: dict, max_pos: int, dtype=torch.float32):
    ctx, block = _positions(max_pos)
    rope_q, rope_k = drafter.rotary(ctx, block, dtype)
    ref = _hf_rotary(export_cfg)
    x = torch.zeros(1, dtype=dtype)
    all_pos = torch.cat([ctx, block], dim=1)
    cos_ref, sin_ref = ref(x, all_pos)        # one forward over every position (what a served step computes)
    torch.testing.assert_close(rope_k[0], cos_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(rope_k[1], sin_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(rope_q[0], cos_ref[:, -block.shape[1]:], rtol=0, atol=1e-6)
    assert drafter.rope.attention_scaling == pytest.approx(ref.attention_scaling)


@pytest.mark.parametrize("name", sorted(ROPES))
def test_drafter_rope_matches_transformers_for_export(name):
    target = {**BASE, "model_type": "llama", "rope_parameters": copy.deepcopy(ROPES[name])}
    drafter = _drafter_for(target)
    export_cfg = _export(drafter, target)
    assert export_cfg["rope_parameters"]["rope_type"] == ROPES[name]["rope_type"]
    # the exported config reads back as the same RoPE
    back = drafter_config_from_export(export_cfg)
    assert back.rope_params() == drafter.config.rope_params()
    assert DFlashDrafter(back, "sdpa").rope.attention_scaling == drafter.rope.attention_scaling
    _check(drafter, export_cfg, 48)
    _check(drafter, export_cfg, 48, torch.bfloat16)
    if name in ("dynamic", "longrope"):
        _check(drafter, export_cfg, 3000 if name == "dynamic" else 300)  # past the length that switches
    if name.startswith("yarn"):
        assert drafter.rope.attention_scaling != 1.0   # the attention factor is applied to cos/sin


@pytest.mark.parametrize("head_dim,theta", [(16, 10000.0), (128, 1e6), (64, 5e5), (256, 1e7)])
def test_default_rope_is_transformers_bit_for_bit(head_dim, theta):
    """The drafter's own 'default' init (kept out of transformers' modeling import) is Qwen3's, to the bit."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    cfg = Qwen3Config(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=4, head_dim=head_dim,
                      rope_parameters={"rope_type": "default", "rope_theta": theta})
    ours, scaling = default_rope_parameters(cfg, device=torch.device("cpu"))
    ref, ref_scaling = Qwen3RotaryEmbedding.compute_default_rope_parameters(cfg, device=torch.device("cpu"))
    assert ours.dtype == ref.dtype and torch.equal(ours, ref)
    assert scaling == ref_scaling


def test_default_rope_on_llama3_config_fails_the_check():
    """The check above would catch a drafter that ignored the scaling (the old hand-written default RoPE)."""
    target = {**BASE, "model_type": "llama", "rope_parameters": copy.deepcopy(ROPES["llama3"])}
    drafter = _drafter_for(target)
    export_cfg = _export(drafter, target)
    wrong = DFlashDrafter(DrafterModelConfig.from_target({**BASE, "rope_theta": 500000.0}, num_layers=1,
                                                         num_feature_layers=2, block_size=4), "sdpa")
    with pytest.raises(AssertionError):
        _check(wrong, export_cfg, 48)
    # and a yarn one without its attention factor
    target = {**BASE, "model_type": "llama", "rope_parameters": copy.deepcopy(ROPES["yarn"])}
    drafter = _drafter_for(target)
    export_cfg = _export(drafter, target)
    drafter.rope.attention_scaling = 1.0
    with pytest.raises(AssertionError):
        _check(drafter, export_cfg, 48)


def test_target_rotary_classes_agree():
    """The drafter's cos/sin equal the target family's own rotary embedding (gpt-oss: half-dim cos/sin of the
    same frequencies; llama3; Qwen3.5 text M-RoPE with text-only positions on every axis)."""
    from transformers import GptOssConfig, LlamaConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    pos = torch.arange(40)[None]
    x = torch.zeros(1)
    gcfg = GptOssConfig(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=2, head_dim=D,
                        num_hidden_layers=2, num_local_experts=2, vocab_size=100)
    d = _drafter_for(gcfg)
    cos, sin = GptOssRotaryEmbedding(gcfg)(x, pos)
    c2, s2 = d.rope.cos_sin(pos, torch.float32)
    torch.testing.assert_close(c2, torch.cat([cos, cos], -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(s2, torch.cat([sin, sin], -1), rtol=0, atol=1e-6)
    assert d.rope.attention_scaling == pytest.approx(GptOssRotaryEmbedding(gcfg).attention_scaling)
    assert d.rope.attention_scaling > 1.0
    lcfg = LlamaConfig(**{k: v for k, v in BASE.items()}, rope_parameters=copy.deepcopy(ROPES["llama3"]))
    d = _drafter_for(lcfg)
    cos, sin = LlamaRotaryEmbedding(lcfg)(x, pos)
    torch.testing.assert_close(d.rope.cos_sin(pos, torch.float32)[0], cos, rtol=0, atol=1e-6)


def test_qwen3_5_mrope_text_positions_reduce_to_1d():
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
    tcfg = Qwen3_5TextConfig(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=2, head_dim=D,
                             num_hidden_layers=4, vocab_size=100,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e7, "mrope_section": [2, 3, 3],
                                              "mrope_interleaved": True, "partial_rotary_factor": 1.0})
    params = drafter_rope_parameters(tcfg)
    assert params == {"rope_type": "default", "rope_theta": 1e7}
    ref = Qwen3_5TextRotaryEmbedding(tcfg)
    pos = torch.arange(30)[None]
    cos, sin = ref(torch.zeros(1), pos[None].expand(3, 1, -1))  # text-only: the same position on every axis
    c2, s2 = _drafter_for(tcfg).rope.cos_sin(pos, torch.float32)
    torch.testing.assert_close(c2, cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(s2, sin, rtol=0, atol=1e-6)


def test_partial_rotary_factor_not_exported():
    """Qwen3-Next / Qwen3.5 rotate a quarter of each head; the drafter (exported as Qwen3) rotates all of it
    with the same theta, and the export says so (what the served Qwen3 computes)."""
    target = {**BASE, "model_type": "qwen3_next",
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}
    drafter = _drafter_for(target)
    export_cfg = _export(drafter, target)
    assert "partial_rotary_factor" not in export_cfg["rope_parameters"]
    assert drafter.rope.inv_freq.shape[0] == D // 2
    _check(drafter, export_cfg, 32)


def test_rope_refusals():
    with pytest.raises(ConfigError, match="not one transformers implements"):
        drafter_rope_parameters({"rope_parameters": {"rope_type": "nope", "rope_theta": 1.0}})
    with pytest.raises(ConfigError, match="rope_theta"):
        drafter_rope_parameters({"hidden_size": 8})
    with pytest.raises(ConfigError, match="rotary dims"):
        DrafterRope({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5}, head_dim=D,
                    hidden_size=H, num_attention_heads=HEADS, max_position_embeddings=64)


def test_rotary_cos_sin_scaling():
    inv = torch.tensor([1.0, 0.5])
    c, s = rotary_cos_sin(torch.arange(3)[None], inv, torch.float32, 2.0)
    c1, s1 = rotary_cos_sin(torch.arange(3)[None], inv, torch.float32)
    torch.testing.assert_close(c, 2 * c1)


def test_tf4_rope_scaling_form():
    """transformers 4 configs (rope_theta + rope_scaling with 'type') read as the same parameters."""
    p = drafter_rope_parameters({"rope_theta": 5e5, "max_position_embeddings": 128,
                                 "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0}})
    assert p == {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 128}


def test_unmirrorable_families_refused_by_name():
    from transformers import DeepseekV3Config, Gemma2Config
    ds = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=100)
    with pytest.raises(ConfigError, match="deepseek_v3: multi-head latent attention"):
        DrafterModelConfig.from_target(ds, num_layers=1, num_feature_layers=2, block_size=4)
    g2 = Gemma2Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=100, head_dim=16)
    with pytest.raises(ConfigError, match="gemma2: logit softcapping"):
        DrafterModelConfig.from_target(g2, num_layers=1, num_feature_layers=2, block_size=4)


def test_positions_a_target_covers_and_max_length_against_them():
    """max_position_embeddings, or a scaled RoPE's factor x original positions where that is more; a longer
    data.max_length is refused naming both, one that only RoPE scaling allows is said."""
    from transformers import Qwen3Config
    plain = Qwen3Config(max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert position_limit(plain) == (512, None)
    assert check_positions(512, plain) is None
    with pytest.raises(ConfigError) as e:
        check_positions(513, plain)
    assert str(e.value) == ("data.max_length=513 is beyond the target's positions: max_position_embeddings 512 and "
                            "no RoPE scaling that reaches further; set data.max_length <= 512")
    yarn = {"max_position_embeddings": 512, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4,
                                                                  "factor": 4.0, "original_max_position_embeddings": 256}}
    assert position_limit(yarn) == (1024, "yarn RoPE scaling, factor 4 x 256")
    assert check_positions(1000, yarn) == ("data.max_length=1000 is beyond the target's max_position_embeddings 512: "
                                           "allowed by its yarn RoPE scaling, factor 4 x 256 = 1024 positions")
    with pytest.raises(ConfigError, match=r"max_position_embeddings 512, yarn RoPE scaling, factor 4 x 256 = 1024"):
        check_positions(1025, yarn)
    # transformers 4's rope_scaling, no original: the factor stretches max_position_embeddings
    assert position_limit({"max_position_embeddings": 100, "rope_scaling": {"type": "linear", "factor": 2}})[0] == 200
    # llama3 configs already say the scaled length (131072 >= 8 x 8192): nothing more
    assert position_limit({"max_position_embeddings": 131072, "rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}}) == (131072, None)
    # per-layer-type RoPE: the smallest reach; no max_position_embeddings: nothing to check
    nested = {"max_position_embeddings": 64, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0}, "sliding_attention": {"rope_type": "default"}}}
    assert position_limit(nested) == (64, None)
    assert position_limit({"rope_parameters": {}}) == (None, None) and check_positions(10 ** 6, {}) is None
