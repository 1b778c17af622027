"""Target fast-path check: a tiny Qwen3-Next on CPU reports the PyTorch fallback; require raises with the fix."""

import logging
import sys
import types

import pytest
import torch
from torch import nn

from dflash_dist.targets.families.hybrid_packing import bound_kernel
from dflash_dist.targets.fast_path import (
    FastPathError,
    check_fast_path_for_config,
    check_target_fast_path,
    resolve_policy,
)


def tiny_qwen3_next_config():
    from transformers import Qwen3NextConfig
    return Qwen3NextConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=2,
                           linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=2,
                           num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                           layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=128)


@pytest.fixture(scope="module")
def qwen3_next():
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_qwen3_next_config(), attn_implementation="sdpa").eval()


def _fla_installed() -> bool:
    try:
        import fla  # noqa: F401
        return True
    except Exception:
        return False


pytestmark = pytest.mark.skipif(_fla_installed(), reason="fla is installed: the CPU fallback cannot be observed")


def test_policy_resolution():
    assert resolve_policy("auto", "cuda") == "require" and resolve_policy("auto", "cpu") == "allow"
    with pytest.raises(ValueError):
        resolve_policy("maybe", "cpu")


def test_tiny_qwen3_next_on_cpu_reports_fallback(qwen3_next):
    r = check_target_fast_path(qwen3_next, "allow", "cpu")
    assert r["hybrid"] and r["effective_policy"] == "allow"
    kind = r["kinds"]["Qwen3NextGatedDeltaNet"]
    assert kind["count"] == 3 and kind["layers"] == [0, 1, 2]
    assert kind["fla"] is False and kind["causal_conv1d"] is False
    assert kind["bindings"]["chunk_gated_delta_rule"]["source"] == "torch"
    assert r["attn_implementation"] == "sdpa"
    assert set(r["missing"]) == {"fla", "causal_conv1d"}
    assert check_target_fast_path(qwen3_next, "auto", "cpu")["effective_policy"] == "allow"  # auto on CPU
    with torch.no_grad():  # the fallback it reports is the one that runs
        assert torch.isfinite(qwen3_next(torch.randint(0, 64, (1, 9))).logits).all()


def test_require_raises_with_install_instructions(qwen3_next):
    with pytest.raises(FastPathError) as ei:
        check_target_fast_path(qwen3_next, "require", "cpu")
    msg = str(ei.value)
    assert "pip install flash-linear-attention" in msg
    assert "causal-conv1d" in msg and "build_causal_conv1d.sh" in msg
    with pytest.raises(FastPathError):
        check_target_fast_path(qwen3_next, "auto", "cuda")  # auto = require on CUDA


def test_warn_logs(qwen3_next, caplog):
    with caplog.at_level(logging.WARNING, logger="dflash_dist"):
        r = check_target_fast_path(qwen3_next, "warn", "cpu")
    assert r["missing"] and any("flash-linear-attention" in rec.getMessage() for rec in caplog.records
                                if rec.levelno == logging.WARNING)


def test_config_only_check_matches_model_check():
    from transformers import Qwen3_5TextConfig
    r = check_fast_path_for_config(tiny_qwen3_next_config(), "allow", "cpu", attn_implementation="sdpa")
    assert r["kinds"]["Qwen3NextGatedDeltaNet"]["layers"] == [0, 1, 2]
    assert set(r["missing"]) == {"fla", "causal_conv1d"} and r["attn_implementation"] == "sdpa"
    q35 = Qwen3_5TextConfig(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
    r = check_fast_path_for_config(q35, "allow", "cpu")
    assert "Qwen3_5GatedDeltaNet" in r["kinds"] and r["missing"]
    with pytest.raises(FastPathError, match="flash-linear-attention"):
        check_fast_path_for_config(q35, "require", "cuda")


def test_dense_target_has_no_hybrid_layers():
    from transformers import AutoModelForCausalLM, Qwen3Config
    cfg = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    r = check_target_fast_path(m, "require", "cuda")       # nothing to require: no raise
    assert not r["hybrid"] and r["summary"].startswith("no hybrid layers") and r["attn_implementation"] == "sdpa"
    assert not check_fast_path_for_config(cfg, "require", "cuda")["hybrid"]


def _fake_fla(monkeypatch):
    """A stand-in ``fla`` package so the 'bound' branch is exercised without the real (GPU-only) one."""
    def chunk_gated_delta_rule(q, k, v, g, beta, **kw):
        raise AssertionError("not called")
    mod = types.ModuleType("fla.ops.gated_delta_rule")
    chunk_gated_delta_rule.__module__ = mod.__name__
    mod.chunk_gated_delta_rule = chunk_gated_delta_rule
    ops = types.ModuleType("fla.ops")
    ops.gated_delta_rule = mod
    fla = types.ModuleType("fla")
    fla.ops = ops
    for name, m in (("fla", fla), ("fla.ops", ops), ("fla.ops.gated_delta_rule", mod)):
        monkeypatch.setitem(sys.modules, name, m)
    return chunk_gated_delta_rule


def test_bound_kernel_is_detected_new_style(qwen3_next, monkeypatch):
    """transformers >= 5.2x: the module-level wrapper's closure holds the package function."""
    from transformers.integrations import hub_kernels, use_kernel_func_from_hub_with_fallback
    from transformers.models.qwen3_next import modeling_qwen3_next as mq
    _fake_fla(monkeypatch)
    torch_fn = bound_kernel(mq.torch_chunk_gated_delta_rule)
    assert torch_fn.__module__ == mq.__name__ and torch_fn.__name__ == "torch_chunk_gated_delta_rule"
    wrapped = use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")(torch_fn)
    assert bound_kernel(wrapped).__module__ == "fla.ops.gated_delta_rule"
    if "cpu" not in getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", {}).get("fla", ("cpu",)):
        assert bound_kernel(wrapped, "cpu") is torch_fn  # transformers >= 5.25: fla's kernel runs on CUDA only
    assert bound_kernel(wrapped, "cuda").__module__ == "fla.ops.gated_delta_rule"
    monkeypatch.setattr(mq, "torch_chunk_gated_delta_rule", wrapped)
    r = check_target_fast_path(qwen3_next, "allow", "cpu")
    kind = r["kinds"]["Qwen3NextGatedDeltaNet"]
    assert kind["fla"] is True and kind["causal_conv1d"] is False and r["missing"] == ["causal_conv1d"]
    with pytest.raises(FastPathError) as ei:
        check_target_fast_path(qwen3_next, "require", "cuda")
    assert "causal-conv1d" in str(ei.value) and "pip install flash-linear-attention" not in str(ei.value)


def test_bound_kernel_is_detected_old_style(monkeypatch):
    """Older transformers copy the chosen functions onto the layer (None when the package is missing)."""
    fake = _fake_fla(monkeypatch)

    class OldGatedDeltaNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer_idx = 0
            self.chunk_gated_delta_rule = fake
            self.causal_conv1d_fn = None

    r = check_target_fast_path(nn.Sequential(OldGatedDeltaNet()), "allow", "cuda")
    kind = r["kinds"]["OldGatedDeltaNet"]
    assert kind["fla"] is True and kind["causal_conv1d"] is False
    assert kind["bindings"]["causal_conv1d_fn"]["source"] == "none"
