"""A tiny random Qwen3 target and DFlash drafter for the decoding tests (eval/): float64 on CPU by default."""

import torch

from dflash_dist.model.drafter import DFlashDrafter, DrafterModelConfig, RMSNorm


def tiny_target(vocab: int, hidden: int, layers: int, seed: int = 0, dtype=torch.float64):
    from transformers import AutoModelForCausalLM, Qwen3Config
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      rope_theta=10000.0)
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return m.eval().requires_grad_(False)


def tiny_drafter(target, num_feature_layers: int, block_size: int, seed: int = 0, dtype=torch.float64):
    """A 2-layer drafter whose norms are not all ones (so a wrong feature order or norm shows)."""
    dcfg = DrafterModelConfig.from_target(target.config, num_layers=2, num_feature_layers=num_feature_layers,
                                          block_size=block_size)
    torch.manual_seed(seed)
    d = DFlashDrafter(dcfg, "sdpa")
    with torch.no_grad():
        for mod in d.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return d.to(dtype).eval()
