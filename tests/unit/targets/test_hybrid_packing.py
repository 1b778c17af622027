"""The packed hybrid capture's plumbing on CPU: the sample boundaries handed to the GatedDeltaNet kernels, and
the refusals (kernels not importable, transformers' PyTorch fallback bound)."""

import pytest
import torch

import dflash_dist.targets.families.hybrid_packing as HP
from dflash_dist.config import ConfigError, TargetConfig
from dflash_dist.targets.families import family_for, text_config
from dflash_dist.targets.hf import build_target_model, load_hf_config
from dflash_dist.roles.target_rank.capture import FeatureCapture, check_packing_config, packing_problem, resolve_packing


def _tcfg(name, **over):
    import os

    import yaml
    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf", "target", f"{name}.yaml")
    with open(path) as f:
        d = yaml.safe_load(f)
    d.pop("defaults", None)
    d.update(over)
    return TargetConfig(**d)


def test_varlen_kwargs_from_lengths():
    """cu_seqlens (device and host copies, int64) and each token's sample index (int32, [1, T])."""
    kw = HP.varlen_kwargs(torch.tensor([3, 2, 4]), "cpu")
    assert set(kw) == {"cu_seq_lens_q", "cu_seqlens_cpu", "seq_idx"}
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 5, 9] and kw["cu_seq_lens_q"].dtype == torch.int64
    assert kw["cu_seqlens_cpu"].tolist() == [0, 3, 5, 9] and kw["cu_seqlens_cpu"].device.type == "cpu"
    assert kw["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]] and kw["seq_idx"].dtype == torch.int32
    # every forward kwarg reaches a kernel argument (transformers renames cu_seq_lens_q to cu_seqlens)
    assert set(HP.BOUNDARY_KWARGS.values()) == {arg for _, arg in HP.VARLEN_KERNELS.values()}


def test_config_refusal_names_the_missing_kernels(monkeypatch):
    """Before weights load: a hybrid is packable only with both kernels importable; the message names the missing
    ones, and target.packing=on is refused by name."""
    hf = load_hf_config(_tcfg("tiny_qwen3_5"))
    rule = family_for(hf).packing_problem
    monkeypatch.setattr(HP, "missing_packages", lambda: ["causal_conv1d"])
    problem = rule(text_config(hf), None)
    assert problem.startswith("decoder layer 0 is linear_attention (GatedDeltaNet): packed rows need")
    assert problem.endswith("not importable: causal_conv1d")
    with pytest.raises(ConfigError, match="target.packing=on: decoder layer 0 is linear_attention"):
        check_packing_config(_tcfg("tiny_qwen3_5", packing="on"), hf)
    monkeypatch.setattr(HP, "missing_packages", lambda: [])
    assert rule(text_config(hf), None) is None
    # other layer kinds stay refused in a hybrid
    assert "is mamba" in rule({"layer_types": ["linear_attention", "mamba"]}, None)


def test_built_model_with_the_pytorch_fallback_is_refused():
    """The kernels transformers bound decide: its PyTorch fallbacks take no boundaries, so packing is refused with
    the reason, FeatureCapture(packing=True) and target.packing=on fail loudly, auto stays padded (reported)."""
    tcfg = _tcfg("tiny_hybrid")
    model = build_target_model(tcfg, "cpu")
    problem = packing_problem(model)
    assert "has linear attention (GatedDeltaNet)" in problem
    assert "runs torch_chunk_gated_delta_rule on transformers' PyTorch fallback" in problem
    assert "fla's kernel, which takes cu_seqlens" in problem
    with pytest.raises(ConfigError, match="packed capture: decoder layer 0"):
        FeatureCapture(model, [1, 2], packing=True)
    tcfg.packing = "on"
    with pytest.raises(ConfigError, match="target.packing=on"):
        resolve_packing(tcfg, model, "cuda")
    tcfg.packing = "auto"
    assert resolve_packing(tcfg, model, "cuda") is False
    cap = FeatureCapture(model, [1, 2])
    assert cap.describe().startswith("padded") and "not packed: decoder layer 0" in cap.describe()
    cap.close()
