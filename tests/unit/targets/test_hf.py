"""The target's attention implementation: auto from what the model class declares and the device, explicit
choices the class does not support refused before any model loads, and the choice in the fast-path line.

CUDA is simulated on CPU where only the choice is tested: it is made from the class's flags and the device type."""

import os
from types import SimpleNamespace

import pytest
import yaml

from dflash_dist.config import ConfigError, TargetConfig
from dflash_dist.targets import hf
from dflash_dist.targets.fast_path import check_fast_path_for_config
from dflash_dist.targets.hf import attn_note, build_target_model, load_hf_config, resolve_attn_implementation

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf", "target")


def _hf_config(name: str) -> dict:
    """A preset's ``hf_config`` alone: what a user writes as ``target.hf_config`` (no attention setting)."""
    with open(os.path.join(CONF, f"{name}.yaml")) as f:
        return dict(yaml.safe_load(f)["hf_config"])


def _tcfg(name: str, **over) -> TargetConfig:
    return TargetConfig(hf_config=_hf_config(name), **over)


def test_auto_is_the_default_and_follows_the_class_and_device(monkeypatch):
    assert TargetConfig(hf_config={"builtin": "tiny"}).attn_implementation == "auto"
    gpt, llama = _tcfg("tiny_gpt_oss"), _tcfg("tiny_llama3")
    gpt_cfg, llama_cfg = load_hf_config(gpt), load_hf_config(llama)
    monkeypatch.setattr(hf, "_flash_attn_installed", lambda: False)
    assert resolve_attn_implementation(gpt, gpt_cfg, "cpu") == "eager"               # no sdpa (sinks)
    assert resolve_attn_implementation(gpt, gpt_cfg, "cuda") == "flex_attention"
    assert resolve_attn_implementation(gpt, gpt_cfg, "cuda:1") == "flex_attention"
    assert resolve_attn_implementation(llama, llama_cfg, "cpu") == "sdpa"
    assert resolve_attn_implementation(llama, llama_cfg, "cuda") == "sdpa"
    assert attn_note(gpt, gpt_cfg, "cpu") == "auto: GptOssForCausalLM on cpu supports eager"
    assert attn_note(_tcfg("tiny_gpt_oss", attn_implementation="eager"), gpt_cfg, "cpu") is None


def test_auto_takes_flash_attention_when_flex_is_not_declared(monkeypatch):
    cls = type("FlashOnly", (), {"_supports_sdpa": False, "_supports_flex_attn": False, "_supports_flash_attn": True})
    monkeypatch.setattr(hf, "target_model_class", lambda c: cls)
    monkeypatch.setattr(hf, "_flash_attn_installed", lambda: True)
    assert resolve_attn_implementation(_tcfg("tiny_llama3"), None, "cuda") == "flash_attention_2"
    assert resolve_attn_implementation(_tcfg("tiny_llama3"), None, "cpu") == "eager"
    monkeypatch.setattr(hf, "_flash_attn_installed", lambda: False)
    assert resolve_attn_implementation(_tcfg("tiny_llama3"), None, "cuda") == "eager"


def test_unsupported_explicit_choice_is_refused_before_any_model_loads(monkeypatch):
    def no_build(*a, **k):
        raise AssertionError("a model was built")
    from transformers import AutoModelForCausalLM
    monkeypatch.setattr(AutoModelForCausalLM, "from_config", no_build)
    with pytest.raises(ConfigError) as e:
        build_target_model(_tcfg("tiny_gpt_oss", attn_implementation="sdpa"), "cpu")
    msg = str(e.value)
    assert msg.startswith("target.attn_implementation=sdpa: GptOssForCausalLM does not support it")
    assert "choose one of auto, eager (auto picks eager on cpu)" in msg
    with pytest.raises(ConfigError, match="flash attention kernels need CUDA"):
        build_target_model(_tcfg("tiny_llama3", attn_implementation="flash_attention_2"), "cpu")


def test_auto_without_a_class_to_ask_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="set target.attn_implementation to sdpa, flex_attention"):
        resolve_attn_implementation(_tcfg("tiny_llama3"), SimpleNamespace(model_type="mine"), "cpu")
    assert resolve_attn_implementation(_tcfg("tiny_llama3", attn_implementation="eager"),
                                       SimpleNamespace(model_type="mine"), "cpu") == "eager"


def test_gpt_oss_without_an_attention_setting_builds_and_reports_it():
    tcfg = _tcfg("tiny_gpt_oss")
    model = build_target_model(tcfg, "cpu")          # was: transformers refused the sdpa it was given
    assert model.config._attn_implementation == "eager"
    hf_config = load_hf_config(tcfg)
    fp = check_fast_path_for_config(hf_config, "allow", "cpu", resolve_attn_implementation(tcfg, hf_config, "cpu"),
                                    attn_note(tcfg, hf_config, "cpu"))
    assert "attention: eager (auto: GptOssForCausalLM on cpu supports eager)" in fp["summary"]


def test_gpt_oss_checkpoint_given_as_target_hf_builds_without_an_attention_setting(tmp_path):
    """``target=hf target.name_or_path=DIR`` of a gpt-oss checkpoint, the way the README gives any target."""
    build_target_model(_tcfg("tiny_gpt_oss", attn_implementation="eager"), "cpu").save_pretrained(tmp_path)
    tcfg = TargetConfig(name_or_path=str(tmp_path))
    assert tcfg.attn_implementation == "auto"
    assert build_target_model(tcfg, "cpu").config._attn_implementation == "eager"
