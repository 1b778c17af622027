"""MoE experts and attention in the target fast-path report; require refuses eager experts on CUDA.

The CUDA case is simulated on CPU: the check takes device_type, and the experts' implementation is read off the
built model (what transformers resolved, and its own per-call grouped_mm test on the experts' weights)."""

import os

import pytest
import yaml

from dflash_dist.config import TargetConfig
from dflash_dist.targets.families.moe import experts_report
from dflash_dist.targets.fast_path import FastPathError, attention_report, check_target_fast_path
from dflash_dist.targets.hf import build_target_model

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf", "target")


def _tcfg(name: str, **over) -> TargetConfig:
    with open(os.path.join(CONF, f"{name}.yaml")) as f:
        d = yaml.safe_load(f)
    d.pop("defaults", None)  # a preset: the fields that differ from TargetConfig's defaults
    d.update(over)
    return TargetConfig(**d)


@pytest.fixture(scope="module")
def moe():
    return build_target_model(_tcfg("tiny_qwen3_moe"), "cpu")


def test_grouped_mm_reported(moe, caplog):
    rep = experts_report(moe)
    assert rep["implementation"] == "grouped_mm" and rep["classes"] == ["Qwen3MoeExperts"] and rep["count"] == 8
    assert rep["grouped_mm_usable"] is True
    with caplog.at_level("INFO", logger="dflash_dist"):
        r = check_target_fast_path(moe, "require", "cuda")   # grouped_mm: accepted on (simulated) CUDA
    assert "MoE experts: grouped_mm (Qwen3MoeExperts x8" in r["summary"]
    assert "attention: sdpa" in r["summary"]
    assert "MoE experts: grouped_mm" in caplog.text


def test_eager_experts_refused_on_cuda():
    model = build_target_model(_tcfg("tiny_qwen3_moe", experts_implementation="eager"), "cpu")
    assert experts_report(model)["implementation"] == "eager"
    with pytest.raises(FastPathError, match="MoE experts run eager on CUDA.*target.experts_implementation=grouped_mm"):
        check_target_fast_path(model, "require", "cuda")
    with pytest.raises(FastPathError, match="MoE experts run eager"):
        check_target_fast_path(model, "auto", "cuda")
    assert "experts: eager" in check_target_fast_path(model, "warn", "cuda")["summary"]
    assert "experts: eager" in check_target_fast_path(model, "require", "cpu")["summary"]  # CPU: only reported


def test_silent_class_level_fallback_is_caught(monkeypatch):
    """transformers turns grouped_mm into eager without a word when the class cannot dispatch it
    (get_correct_experts_implementation swallows the error): the check sees what was resolved."""
    from transformers import PreTrainedModel

    def cannot(self):
        raise ValueError("no grouped_mm for this class")
    monkeypatch.setattr(PreTrainedModel, "_grouped_mm_can_dispatch", cannot)
    model = build_target_model(_tcfg("tiny_qwen3_moe"), "cpu")
    assert experts_report(model)["implementation"] == "eager"
    with pytest.raises(FastPathError, match="eager"):
        check_target_fast_path(model, "require", "cuda")


def test_silent_per_call_fallback_is_caught(moe, monkeypatch):
    """grouped_mm configured, but transformers' per-call test says no (old torch, old GPU, fp32 under compile):
    it runs its loop over experts; reported as such and refused on CUDA."""
    import transformers.integrations.moe as moe_mod
    monkeypatch.setattr(moe_mod, "_can_use_grouped_mm", lambda *a, **k: False)
    rep = experts_report(moe)
    assert rep["implementation"] == "grouped_mm->fallback_loop" and "grouped_mm_fallback" in rep["detail"]
    with pytest.raises(FastPathError, match="fallback_loop"):
        check_target_fast_path(moe, "require", "cuda")


def test_dense_and_gpt_oss_reports():
    dense = build_target_model(_tcfg("tiny_llama3"), "cpu")
    assert experts_report(dense) is None
    assert "MoE experts: none" in check_target_fast_path(dense, "require", "cuda")["summary"]
    gpt = build_target_model(_tcfg("tiny_gpt_oss"), "cpu")
    rep = experts_report(gpt)
    assert rep["classes"] == ["GptOssExperts"] and rep["implementation"] == "grouped_mm"
    att = attention_report(gpt, "cpu")
    assert att["attn_implementation"] == "eager" and att["sdpa_backend"] is None
