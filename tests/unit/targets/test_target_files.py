"""targets/target_files: a target's directory and config are checked where they enter, each refusal one line naming
the location, the field and what is allowed; a pickled checkpoint is never unpickled."""

import json
import os
import pickle
import shutil

import pytest

from dflash_dist.config import ConfigError, TargetConfig
from dflash_dist.targets.hf import TINY_DIR, build_target_model, load_hf_config


def target_dir(tmp_path, name="t", **config):
    d = tmp_path / name
    shutil.copytree(TINY_DIR, d, ignore=shutil.ignore_patterns("regenerated.jsonl"))
    cfg = json.loads((d / "config.json").read_text())
    for k, v in config.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def refused(tcfg, *needles):
    with pytest.raises(ConfigError) as e:
        load_hf_config(tcfg)
    msg = str(e.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg
    return msg


class _Runs:
    """Unpickling this makes a directory: the proof that a pickle ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_pickled_target_is_refused_and_never_unpickled(tmp_path):
    d = target_dir(tmp_path)
    os.remove(os.path.join(d, "model.safetensors"))
    marker = str(tmp_path / "pickle_ran")
    with open(os.path.join(d, "pytorch_model.bin"), "wb") as f:
        pickle.dump({"model.embed_tokens.weight": _Runs(marker)}, f)
    refused(TargetConfig(name_or_path=d), "pytorch_model.bin is a pickle", "never read", "safetensors")
    with pytest.raises(ConfigError, match="is a pickle"):
        build_target_model(TargetConfig(name_or_path=d), "cpu")
    assert not os.path.exists(marker)
    os.remove(os.path.join(d, "pytorch_model.bin"))
    refused(TargetConfig(name_or_path=d), "no model.safetensors")


def test_weights_load_from_safetensors_only(tmp_path, monkeypatch):
    """A hub id is not checked before transformers fetches it: transformers is told to take safetensors only."""
    import transformers
    seen = {}
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(path, *a, **k):
        seen.update(k)
        return real(path, *a, **k)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    build_target_model(TargetConfig(name_or_path=target_dir(tmp_path)), "cpu")
    assert seen.get("use_safetensors") is True


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}


@pytest.mark.parametrize("params, needle", [
    (dict(YARN, factor=0.0), "rope_parameters.factor=0.0: a finite number > 0"),
    (dict(YARN, factor=-2.0), "rope_parameters.factor=-2.0"),
    (dict(YARN, original_max_position_embeddings=0), "original_max_position_embeddings=0: a whole number > 0"),
    (dict(YARN, original_max_position_embeddings=1.5), "original_max_position_embeddings=1.5"),
    (dict(YARN, beta_fast=0), "beta_fast=0"),
    (dict(YARN, factor="4"), "rope_parameters.factor='4'"),
    ({"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 1024}, "equals high_freq_factor"),
    ({"rope_type": "default", "rope_theta": 0.0}, "rope_theta=0.0"),
])
def test_rope_values_transformers_cannot_compute_are_refused(tmp_path, params, needle):
    """A local directory (checked before transformers' own validation, which divides by
    original_max_position_embeddings) and a target.hf_config dict alike."""
    refused(TargetConfig(name_or_path=target_dir(tmp_path, rope_parameters=params, rope_scaling=None)),
            "config.json: ", needle)
    cfg = json.loads(open(os.path.join(TINY_DIR, "config.json")).read())
    refused(TargetConfig(hf_config=dict(cfg, rope_parameters=params), tokenizer=TINY_DIR), "target.hf_config", needle)


def test_a_config_transformers_rejects_is_one_line(tmp_path):
    refused(TargetConfig(name_or_path=target_dir(tmp_path, num_attention_heads="four")),
            "the config does not load in transformers")


@pytest.mark.parametrize("model_type, why", [("nosuchmodel", "is not a model type transformers knows"),
                                             (None, "is missing"), (5, "is not a model type"),
                                             ("clip", "is not a causal language model")])
def test_an_unknown_model_type_is_refused_naming_the_families(tmp_path, model_type, why):
    msg = refused(TargetConfig(name_or_path=target_dir(tmp_path, model_type=model_type)), f"model_type={model_type!r}",
                  why, "qwen3 (qwen3, qwen2)", "llama (llama)", "gpt_oss")
    assert "Traceback" not in msg
    cfg = json.loads(open(os.path.join(TINY_DIR, "config.json")).read())
    cfg.pop("model_type")
    hf_config = dict(cfg, **({} if model_type is None else {"model_type": model_type}))
    refused(TargetConfig(hf_config=hf_config, tokenizer=TINY_DIR),
            *(["needs a model_type"] if model_type is None else ["target.hf_config: model_type=", why]))


@pytest.mark.parametrize("qc, needle", [
    ("notadict", "quantization_config='notadict': an object"),
    ({"quant_method": "fp8", "weight_block_size": "x"}, "weight_block_size='x': two whole numbers > 0"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size=[128]"),
    ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "weight_block_size=[0, 128]"),
    ({"quant_method": "fp8", "activation_scheme": 5}, "activation_scheme=5: a string"),
    ({"quant_method": "fp8", "fmt": ["e4m3"]}, "fmt=['e4m3']"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": "x"},
     "config_groups='x': an object of named groups"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": 3}},
     "only 8-bit float weights"),
    ({"quant_method": "weird"}, "quant_method='weird' does not load"),
    ({"bits": 4}, "quant_method=None does not load"),
])
def test_a_malformed_quantization_config_is_refused(tmp_path, qc, needle):
    refused(TargetConfig(name_or_path=target_dir(tmp_path, quantization_config=qc)), "config.json: ", needle)


def test_the_dflash_train_check_says_it_in_one_line(tmp_path, capsys):
    from dflash_dist.cli.train import main
    d = target_dir(tmp_path, rope_parameters=dict(YARN, original_max_position_embeddings=0))
    assert main(["--nproc-per-node", "3", "--cfg", "job", "target=hf", f"target.name_or_path={d}"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("dflash_dist: configuration error: target.name_or_path=") and \
        "original_max_position_embeddings=0" in err[0]
