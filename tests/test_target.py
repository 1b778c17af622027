"""Target capture: layer id i is HF hidden_states[i+1], later layers do not run, no lm_head."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3NextConfig

from dflash_dist.config import TargetConfig
from dflash_dist.target import FeatureCapture, build_target_model, load_hf_config


def tiny(kind):
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    if kind == "qwen3":
        return Qwen3Config(num_hidden_layers=8, head_dim=8, **common)
    if kind == "llama":
        return LlamaConfig(num_hidden_layers=8, **common)
    return Qwen3NextConfig(num_hidden_layers=8, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                           linear_key_head_dim=8, linear_value_head_dim=8, mlp_only_layers=list(range(8)),
                           num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                           shared_expert_intermediate_size=16, **common)


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen3_next"])
def test_capture_equals_hf_hidden_states(kind):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny(kind)).eval()
    ids = torch.randint(0, 128, (2, 11))
    lengths = torch.tensor([11, 7])
    layer_ids = [1, 2, 4, 5]
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states
    ran = []
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
             for i, layer in enumerate(model.get_decoder().layers)]
    cap = FeatureCapture(model, layer_ids)
    feats = cap(ids, lengths)
    assert feats.shape == (18, len(layer_ids) * 32)
    expect = torch.cat([ref[i + 1] for i in layer_ids], dim=-1)                       # hidden_states[i+1]
    keep = torch.arange(11)[None] < lengths[:, None]
    torch.testing.assert_close(feats, expect[keep], rtol=1e-5, atol=1e-5)
    assert max(ran) == 5, "decoder layers after the last needed one must not run"
    # right padding does not change the real tokens' features (causal): sample 1 alone
    alone = FeatureCapture.__call__(cap, ids[1:2, :7], torch.tensor([7]))
    torch.testing.assert_close(alone, feats[11:], rtol=1e-5, atol=1e-5)
    for h in hooks:
        h.remove()


def test_last_layer_id_gets_final_norm_like_hf():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny("qwen3")).eval()
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states
    feats = FeatureCapture(model, [7])(ids, torch.tensor([6]))
    torch.testing.assert_close(feats, ref[8][0], rtol=1e-5, atol=1e-5)


def test_random_init_is_seeded_and_frozen():
    cfg = TargetConfig(hf_config={"builtin": "tiny"}, name_or_path=None)
    hf = load_hf_config(cfg)
    assert hf.num_hidden_layers == 8
    a = build_target_model(TargetConfig(hf_config=dict(tiny("qwen3").to_dict(), model_type="qwen3"), init_seed=3), "cpu")
    b = build_target_model(TargetConfig(hf_config=dict(tiny("qwen3").to_dict(), model_type="qwen3"), init_seed=3), "cpu")
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not any(p.requires_grad for p in a.parameters()) and not a.training
