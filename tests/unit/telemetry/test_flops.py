"""FLOP formulas behind every MFU number (trainer metrics and bench/), and the per-window role metrics."""

from types import SimpleNamespace

import pytest
import torch
from helpers.toy_seams import ScaledDFlash

from dflash_dist.roles.drafter_rank.trainer import DrafterTrainer
from dflash_dist.model.blocks import make_batch
from dflash_dist.model.drafter import DrafterModelConfig
from dflash_dist.model.variants import DFlash
from dflash_dist.telemetry.flops import attention_flops_per_pair, drafter_step_flops, target_forward_flops
from dflash_dist.telemetry.metrics import target_window_metrics


def mc(layers=2):
    return DrafterModelConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                              intermediate_size=16, num_layers=layers, num_feature_layers=2, rms_norm_eps=1e-6,
                              rope_theta=1e4, block_size=4, vocab_size=10, max_position_embeddings=64)


def test_attention_counts_every_layer():
    """Attention runs in every drafter layer: 4*d per visible pair and head, x3.5 with backward, x L."""
    pairs = 4 * (3 + 4)
    one, two = (drafter_step_flops(mc(n), b=1, s_pad=16, n_blocks=2, vocab=10, visible_pairs=pairs) for n in (1, 2))
    assert one["attention"] == 3.5 * 4 * 4 * 2 * pairs
    assert two["attention"] == 2 * one["attention"]
    assert attention_flops_per_pair(mc(2)) * pairs == two["attention"]
    assert two["model"] == pytest.approx(two["matmul"] + two["attention"] + two["lm_head"])


def test_target_forward_flops_by_hand():
    tc = SimpleNamespace(hidden_size=8, num_attention_heads=2, head_dim=4, vocab_size=10)
    # 2 sequences of 3 tokens, 100 params in the layers that run, 2 of them attention layers
    f = target_forward_flops(tc, run_params=100, attention_layers_run=2, batches=[(2, 3)])
    assert f == 2 * 100 * 6 + 2 * 4 * 4 * 2 * 2 * (3 * 4 / 2)
    assert target_forward_flops(tc, 100, 2, [(2, 3)], lm_head=True) == f + 2 * 6 * 8 * 10


def test_trainer_step_flops_matches_the_formula():
    """DrafterTrainer.step_flops (device-side visible pairs, no sync) == drafter_step_flops with host pairs."""
    m = mc(2)
    g = torch.Generator().manual_seed(0)
    lens = [20, 13]
    ids = torch.randint(0, 10, (sum(lens),), generator=g)
    mask = torch.ones(sum(lens), dtype=torch.bool)
    cu = torch.tensor([0, 20, 33])
    feats = torch.randn(sum(lens), 16)
    batch = make_batch(ids, mask, cu, feats, num_anchors=5, block_size=4, mask_token_id=9, ctx_bucket=16,
                       generator=g)
    fake = SimpleNamespace(cfg=SimpleNamespace(drafter=SimpleNamespace(tuning=SimpleNamespace(
        micro_batches=2, local_loss_groups=0))), block_size=4, variant=DFlash(),
                           mcfg=m, lm_head=torch.zeros(10, 8), heads=None)
    got = DrafterTrainer.step_flops(fake, batch)
    pairs = float((4 * (batch.anchors + 4) * batch.valid).sum())
    want = drafter_step_flops(m, 2, batch.ctx_len, 5, 10, pairs)
    assert float(got) == pytest.approx(want["model"])
    # drafter.tuning.loss_on_target: the served groups' head FLOPs are the target's (counted there), not the drafter's
    fake.heads, batch.src = object(), 1
    assert float(DrafterTrainer.step_flops(fake, batch)) == pytest.approx(want["model"] - want["lm_head"])
    fake.cfg.drafter.tuning.local_loss_groups = 1
    assert float(DrafterTrainer.step_flops(fake, batch)) == pytest.approx(want["model"] - want["lm_head"] / 2)
    # a variant's own FLOPs are added to the step's (the toy's scale: 3 x rows x H)
    fake.variant, fake.heads = ScaledDFlash(), None
    assert float(DrafterTrainer.step_flops(fake, batch)) == pytest.approx(want["model"] + 3.0 * 2 * 5 * 4 * m.hidden_size)


def test_target_window_metrics_rates_and_mfu():
    prev = {3: [1_000_000, 0, 100, 10, 2_000_000, 4_000, 0]}
    now = {3: [2_000_000, 500_000, 400, 40, 4_000_000, 10_000, 300_000], 4: [0, 0, 0, 0, 0, 0, 0]}
    out = target_window_metrics(now, prev, peak_tflops=3e-3)   # peak 3 GFLOP/s
    assert out["target3_busy_frac"] == 0.5 and out["target3_wait_frac"] == 0.25       # over the window
    assert out["target3_tokens_per_s"] == 150 and out["target3_samples_per_s"] == 15   # over the 2 s window
    assert out["target3_mfu"] == pytest.approx(1.0)                 # 6,000 MFLOP in 2 s = 3 GFLOP/s
    assert out["target3_eval_frac"] == pytest.approx(0.15)         # 0.3 s of evaluation on its waits in 2 s
    assert not any(k.startswith("target4") for k in out)                              # no wall time yet
    assert "target3_mfu" not in target_window_metrics(now, prev, peak_tflops=None)


def test_step_flops_formula_by_hand():
    step_flops = drafter_step_flops
    mc = DrafterModelConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                            intermediate_size=16, num_layers=1, num_feature_layers=2, rms_norm_eps=1e-6,
                            rope_theta=1e4, block_size=4, vocab_size=10, max_position_embeddings=64)
    f = step_flops(mc, b=1, s_pad=16, n_blocks=2, vocab=10, visible_pairs=4 * (3 + 4), train=True)
    rows_q, rows_c = 8, 16
    fc = 2 * rows_c * 16 * 8
    layer = 2 * rows_q * 8 * 8 + 4 * (rows_c + rows_q) * 8 * 4 + 2 * rows_q * 8 * 8 + 6 * rows_q * 8 * 16
    assert f["matmul"] == 2 * fc + 3 * layer                    # fc x2 (its input needs no grad), layers x3
    assert f["attention"] == 3.5 * 4 * 4 * 2 * 28               # 4*d per pair and head, x3.5 fwd+bwd
    assert f["lm_head"] == 2 * 2 * (2 * 3) * 8 * 10             # slots 1..B-1 only, x2 (fwd + grad input)
    assert f["hardware"] == f["model"]                          # fused loss: the head runs forward once
    g = step_flops(mc, b=1, s_pad=16, n_blocks=2, vocab=10, visible_pairs=4 * (3 + 4), train=True,
                   recompute_head=True)
    assert g["hardware"] - g["model"] == 2 * 6 * 8 * 10         # + the checkpoint's recomputed forward


def _family(name):
    import os

    import yaml

    from dflash_dist.config import TargetConfig
    from dflash_dist.targets.hf import build_target_model
    conf = os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf", "target", f"{name}.yaml")
    with open(conf) as f:
        d = yaml.safe_load(f)
        d.pop("defaults", None)
        return build_target_model(TargetConfig(**d), "cpu")


def test_moe_counts_active_experts_by_hand():
    """tiny_qwen3_moe: H=64, 4 q heads / 2 kv heads of 16, 8 experts of 32 (top-2), router; per layer and token:
    attention projections 2*(64*64 + 2*64*32 + 64*64), router 2*64*8, 2 of 8 experts 2*2*(3*64*32)."""
    from dflash_dist.targets.hf import text_config
    from dflash_dist.telemetry.flops import target_capture_flops, target_layers_profile
    m = _family("tiny_qwen3_moe")
    tc = text_config(m.config)
    prof = target_layers_profile(list(m.model.layers)[:3], tc)
    per_layer = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64) + 2 * 64 * 8 + 2 * 2 * (3 * 64 * 32)
    assert prof["matmul_per_token"] == 3 * per_layer
    assert prof["attention_windows"] == [None] * 3 and prof["linear_per_token"] == 0
    f = target_capture_flops(prof, tc, [(2, 5)])
    assert f == 3 * per_layer * 10 + 3 * (4 * 16 * 4) * 2 * 15
    all_experts = 2 * 8 * (3 * 64 * 32) * 3
    assert prof["matmul_per_token"] < all_experts  # the old count (every expert) would exceed it alone


def test_gpt_oss_sliding_layers_count_their_window():
    from dflash_dist.targets.hf import text_config
    from dflash_dist.telemetry.flops import causal_pairs, target_capture_flops, target_layers_profile
    m = _family("tiny_gpt_oss")
    tc = text_config(m.config)
    prof = target_layers_profile(list(m.model.layers)[:2], tc)
    assert prof["attention_windows"] == [16, None]
    assert causal_pairs(40, 16) == 16 * 17 / 2 + 24 * 16 and causal_pairs(10, 16) == 55
    per_pair = 4 * 16 * 4
    f = target_capture_flops(prof, tc, [(1, 40)])
    assert f == prof["matmul_per_token"] * 40 + per_pair * (causal_pairs(40, 16) + 40 * 41 / 2)
    # gpt-oss experts: gate_up [E, H, 2I] + down [E, I, H], 2 of 4 active; router [E, H]
    per_layer_experts = 2 * 2 * (64 * 128 + 64 * 64)
    attn = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64)
    assert prof["matmul_per_token"] == 2 * (attn + 2 * 64 * 4 + per_layer_experts)


def test_hybrid_counts_linear_attention_layers_by_hand():
    """tiny_hybrid (Qwen3-Next shape): layers 0-2 GatedDeltaNet (4 value heads, d_k = d_v = 16, conv kernel 4 over
    2*2*16 + 4*16 = 128 channels), layer 3 full attention; dense MLPs (mlp_only_layers)."""
    from dflash_dist.targets.hf import text_config
    from dflash_dist.telemetry.flops import target_capture_flops, target_layers_profile
    m = _family("tiny_hybrid")
    tc = text_config(m.config)
    prof = target_layers_profile(list(m.model.layers)[:4], tc)
    assert prof["attention_windows"] == [None]
    assert prof["linear_per_token"] == 3 * (6 * 4 * 16 * 16 + 2 * 4 * 128)
    f = target_capture_flops(prof, tc, [(1, 8)])
    assert f == (prof["matmul_per_token"] + prof["linear_per_token"]) * 8 + 4 * 16 * 4 * 36
