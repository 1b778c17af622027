"""Every configuration error is refused before any model loads, with a message that says what to change."""

import pytest
from helpers.launch_util import torchrun

from dflash_dist.config import ConfigError, JobConfig, default_layer_ids, validate_job
from dflash_dist.roles.drafter_rank.trainer import cosine_lr


def job(**sections) -> JobConfig:
    d = {"target": {"hf_config": {"builtin": "tiny"}}}
    d.update(sections)
    return JobConfig.from_dict(d)


def test_default_layer_ids_match_dflash():
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_layer_ids(28) == [1, 7, 13, 19, 25]  # Qwen3-0.6B
    assert default_layer_ids(30) == [1, 8, 14, 20, 27]  # SmolLM2-135M (never the last layer, 29)
    assert default_layer_ids(8) == [1, 2, 3, 4, 5]


def test_default_layer_ids_of_every_depth_are_distinct_and_below_the_last_layer():
    for n_layers in range(2, 80):
        for n in range(1, 9):
            ids = default_layer_ids(n_layers, n)
            assert ids == sorted(set(ids)) and ids, (n_layers, n, ids)          # distinct, increasing, not empty
            assert 0 <= ids[0] and ids[-1] <= n_layers - 2, (n_layers, n, ids)  # never the last layer (L-1)
            # deep targets keep DFlash's rule; shallow ones get fewer ids only where fewer exist below L-1
            assert len(ids) == min(n, n_layers - 1), (n_layers, n, ids)
    assert default_layer_ids(4) == [0, 1, 2] and default_layer_ids(7) == [0, 1, 2, 4, 5]
    assert default_layer_ids(2) == [0] and default_layer_ids(1) == []


def test_shallow_target_trains_on_default_ids_and_the_last_layer_is_refused():
    assert validate_job(job(), 3, 4, 2048, 3) == [0, 1, 2]      # a 4-layer target (was: refused, ids repeat)
    with pytest.raises(ConfigError) as e:                      # the natural fix of old: refused before models load
        validate_job(job(target={"hf_config": {"builtin": "tiny"}, "layer_ids": [0, 1, 2, 3]}), 3, 4, 2048, 3)
    msg = str(e.value)
    assert "target.layer_ids=[0, 1, 2, 3] holds 3, the last decoder layer" in msg and "vLLM" in msg
    assert "target.layer_ids=[0,1,2]" in msg                     # the fix, ready to paste
    with pytest.raises(ConfigError, match="last decoder layer"):
        validate_job(job(target={"hf_config": {"builtin": "tiny"}, "layer_ids": [1, 7]}), 3, 8, 2048, 3)
    assert validate_job(job(target={"hf_config": {"builtin": "tiny"}, "layer_ids": [1, 6]}), 3, 8, 2048, 3) == [1, 6]
    with pytest.raises(ConfigError, match="no layer below its last"):
        validate_job(job(), 3, 1, 2048, 3)


@pytest.mark.parametrize("section,values,needle", [
    ("drafter", {"block_size": 1}, "block_size"),
    ("drafter", {"num_anchors": 0}, "num_anchors"),
    ("drafter", {"num_layers": 0}, "num_layers"),
    ("drafter", {"attention_backend": "dense"}, "attention_backend"),
    ("drafter", {"attention_backend": "flex", "compile": False}, "compile"),
    ("drafter", {"loss": {"gamma": 0}}, "loss.gamma"),
    ("drafter", {"loss": {"gamma": 1.0, "weights": "flat"}}, "unknown keys"),
    ("drafter", {"tuning": {"compute_weights": "cast"}}, "unknown keys"),  # removed
    ("drafter", {"ctx_bucket": 10}, "ctx_bucket"),
    ("drafter", {"flex_kernel_options": {"bwd_BLOCK_M1": "big"}}, "flex_kernel_options"),
    ("target", {"hf_config": {"builtin": "tiny"}, "dtype": "fp8"}, "target.dtype"),
    ("target", {"hf_config": {"builtin": "tiny"}, "layer_ids": [3, 1]}, "increasing"),
    ("target", {"hf_config": {"builtin": "tiny"}, "layer_ids": [1, 1]}, "duplicates"),
    ("target", {"hf_config": {"builtin": "tiny"}, "fast_path": "maybe"}, "fast_path"),
    ("target", {"hf_config": {"builtin": "tiny"}, "packing": "yes"}, "target.packing"),
    ("target", {"hf_config": {}}, "name_or_path"),
    ("data", {"overlong": "drop"}, "overlong"),
    ("data", {"max_bad_fraction": 2.0}, "max_bad_fraction"),
    ("topology", {"target_ranks": -1}, "target_ranks"),
    ("topology", {"target_ranks": "many"}, "target_ranks"),
    ("topology", {"max_in_flight": 0}, "max_in_flight"),
    ("topology", {"plan_rounds": 0}, "plan_rounds"),
    ("topology", {"plan_min_seconds": -1.0}, "plan_min_seconds"),
    ("train", {"max_steps": 0}, "max_steps"),
    ("train", {"lr": -1}, "lr"),
    ("train", {"warmup_ratio": 1.5}, "warmup_ratio"),
    ("train", {"device": "tpu"}, "device"),
    ("train", {"betas": "xy"}, r"train.betas='xy': give two numbers in \[0, 1\)"),
    ("train", {"betas": [0.9]}, "train.betas"),
    ("train", {"betas": [0.9, 0.95, 0.99]}, "train.betas"),
    ("train", {"betas": [0.9, 1.0]}, "train.betas"),
    ("train", {"betas": [-0.1, 0.95]}, "train.betas"),
    ("train", {"betas": [0.9, "x"]}, "train.betas"),
    ("train", {"betas": [True, 0.95]}, "train.betas"),
    ("logging", {"wandb": {"mode": "sometimes"}}, "wandb.mode"),
    ("logging", {"profile_step": 1}, "profile_step"),
])
def test_field_validation(section, values, needle):
    with pytest.raises(ConfigError, match=needle):
        job(**{section: values})


def test_betas_from_the_command_line():
    """``train.betas=xy`` reaches the config as the string 'xy' (two characters): refused, not trained with."""
    from dflash_dist.config import compose_config
    from dflash_dist.paths import CONF_DIR
    with pytest.raises(ConfigError, match="train.betas='xy'"):
        JobConfig.from_omegaconf(compose_config(["train.betas=xy"], CONF_DIR))
    assert JobConfig.from_omegaconf(compose_config(["train.betas=[0.8,0.9]"], CONF_DIR)).train.betas == [0.8, 0.9]


def test_unknown_keys_rejected():
    with pytest.raises(ConfigError, match="unknown keys"):
        job(train={"learning_rate": 1e-3})
    with pytest.raises(ConfigError, match="unknown config groups"):
        JobConfig.from_dict({"target": {"hf_config": {"builtin": "tiny"}}, "optimizer": {}})


def test_job_level_validation():
    ok = job()
    assert validate_job(ok, world_size=3, num_target_layers=8, vocab_size=2048, mask_token_id=3) == [1, 2, 3, 4, 5]
    with pytest.raises(ConfigError, match="leaves no drafter"):
        validate_job(job(topology={"target_ranks": 3}), 3, 8, 2048, 3)
    with pytest.raises(ConfigError, match="out of range"):
        validate_job(job(target={"hf_config": {"builtin": "tiny"}, "layer_ids": [1, 8]}), 3, 8, 2048, 3)
    with pytest.raises(ConfigError, match="mask_token_id"):
        validate_job(ok, 3, 8, 2048, 4096)
    # a 6-layer target: five distinct default ids below its last layer (were refused as repeating)
    assert validate_job(job(), 3, 6, 2048, 3) == [0, 1, 2, 3, 4]
    with pytest.raises(ConfigError, match="CPU"):
        validate_job(job(drafter={"attention_backend": "flex"}, train={"device": "cpu"}), 3, 8, 2048, 3)


def test_split_rules_are_checked_before_any_topology():
    """target_ranks a multiple of target.tensor_parallel: refused by check_split, which setup and validate_job
    both ask before building a topology; the topology itself only asserts it."""
    from dflash_dist.comm.topology import Topology
    from dflash_dist.config import check_split
    three = job(topology={"target_ranks": 3}, target={"hf_config": {"builtin": "tiny"}, "tensor_parallel": 2})
    with pytest.raises(ConfigError, match="target_ranks=3 is not a multiple of target.tensor_parallel=2.*use 2"):
        check_split(three, 7)
    check_split(job(topology={"target_ranks": 4}, target={"hf_config": {"builtin": "tiny"}, "tensor_parallel": 2}), 7)
    with pytest.raises(AssertionError):
        Topology(7, 0, 3, tp=2)


def test_compiled_layers_need_flex_however_the_backend_resolves():
    """drafter.tuning.compile_layers=true with a backend that resolves to sdpa is refused by the backend's rule
    (config.drafter_backend, asked by check_job_config): given as sdpa, or auto on CPU."""
    from dflash_dist.config import drafter_backend
    for backend in ("sdpa", "auto"):
        cfg = job(drafter={"attention_backend": backend, "tuning": {"compile_layers": True}})
        with pytest.raises(ConfigError, match="drafter.tuning.compile_layers=true needs the flex backend"):
            drafter_backend(cfg.drafter, "cpu")
    auto = job(drafter={"tuning": {"compile_layers": True}}).drafter
    assert drafter_backend(auto, "cuda") == "flex"
    assert drafter_backend(job(drafter={"tuning": {"compile_layers": None}}).drafter, "cpu") == "sdpa"


def test_cosine_schedule():
    assert cosine_lr(0, 100, 0.04) == pytest.approx(0.25)
    assert cosine_lr(3, 100, 0.04) == pytest.approx(1.0)
    assert cosine_lr(99, 100, 0.04) < 0.01
    assert cosine_lr(52, 100, 0.04) == pytest.approx(0.5, abs=0.02)


def test_torchrun_refuses_the_last_layer_before_loading(tmp_path):
    r = torchrun(2, ["-m", "dflash_dist.train", f"train.output_dir={tmp_path}", "target.layer_ids=[1,7]",
                     "logging.wandb.mode=disabled"], timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "configuration error: target.layer_ids=[1, 7] holds 7, the last decoder layer" in out, out[-3000:]
    assert "target loaded" not in out


def test_torchrun_refuses_bad_split_before_loading(tmp_path):
    r = torchrun(2, ["-m", "dflash_dist.train", f"train.output_dir={tmp_path}", "topology.target_ranks=2"],
                 timeout=120)
    assert r.returncode != 0
    assert "topology.target_ranks=2 leaves no drafter rank" in r.stdout + r.stderr
    assert "target loaded" not in r.stdout + r.stderr


def test_hydra_override_errors_become_config_errors(tmp_path):
    """Hydra's own composition errors (an unknown key or option, an unparsable value) are ConfigErrors that name
    what exists; hydra.* overrides take part, Hydra's flags are left to Hydra; a valid command line passes."""
    from dflash_dist.config import check_overrides
    from dflash_dist.train import CONF_DIR
    check_overrides(["drafter=tiny", "train.max_steps=3", "hydra.run.dir=/tmp/x", "hydra.job.chdir=false"],
                    CONF_DIR)
    extra = tmp_path / "conf" / "target"  # hydra.searchpath: presets of the user's own (the same as @hydra.main)
    extra.mkdir(parents=True)
    (extra / "mine.yaml").write_text("defaults: [base, _self_]\nhf_config: {builtin: tiny}\n")
    check_overrides([f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "target=mine"], CONF_DIR)
    with pytest.raises(ConfigError, match="Could not find 'target/mine'"):
        check_overrides(["target=mine"], CONF_DIR)
    check_overrides(["--cfg", "job", "train.nope=1"], CONF_DIR)  # Hydra prints the config (or its own error)
    with pytest.raises(ConfigError, match=r"unknown key 'train.nope'; known in 'train': \[.*'max_steps'"):
        check_overrides(["train.nope=1"], CONF_DIR)
    with pytest.raises(ConfigError, match=r"unknown key 'drafter.tuning.nope'; known in 'drafter.tuning'"):
        check_overrides(["drafter.tuning.nope=1"], CONF_DIR)
    with pytest.raises(ConfigError, match=r"Could not find 'drafter/nope'(.|\n)*dflash") as e:
        check_overrides(["drafter=nope"], CONF_DIR)
    assert "Config search path" not in str(e.value)
    with pytest.raises(ConfigError, match="no viable alternative"):
        check_overrides(["train.max_steps=[1"], CONF_DIR)


def _keys(cls, prefix: str) -> list[str]:
    import dataclasses
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out += _keys(type(default), f"{prefix}{f.name}.") if dataclasses.is_dataclass(default) else [prefix + f.name]
    return out


def test_help_lists_every_key_with_its_docstring_and_the_presets_without_base():
    """dflash-train --help: every key of every group (sub-groups too) once, each followed by the first line of its
    docstring in config/; the presets of conf/ per group, the default job's marked; `base` is no choice."""
    from omegaconf import OmegaConf

    from dflash_dist.cli.help import render_help
    from dflash_dist.config import GROUPS, compose_config
    from dflash_dist.paths import CONF_DIR
    text = render_help(CONF_DIR, OmegaConf.to_container(compose_config([], CONF_DIR), resolve=True))
    lines = text.splitlines()
    keys = [k for group, cls in GROUPS.items() for k in _keys(cls, f"{group}.")]
    assert len(keys) > 80 and "target.tuning.pad_multiple" in keys
    for key in keys:
        (at,) = [i for i, ln in enumerate(lines) if ln.startswith(f"  {key} = ")]
        assert lines[at + 1].startswith("      ") and lines[at + 1].strip(), key
    at = lines.index("  drafter.block_size = 16")
    assert lines[at + 1].strip() == ("Tokens drafted per block: slot 0 is the anchor (known) "
                                     "token, slots 1..B-1 are MASK tokens to predict.")
    groups = {ln.split(":")[0].strip(): ln.split(":", 1)[1].replace(",", " ").split()
              for ln in text.split("config groups (")[1].split("keys (")[0].splitlines()[1:] if ln.strip()}
    assert set(groups) == set(GROUPS)
    assert "tiny*" in groups["target"] and "hf" in groups["target"] and "paper" in groups["train"]
    assert not any("base" in g.rstrip("*") for names in groups.values() for g in names)


def test_flash_backend_refused_where_it_cannot_run(monkeypatch):
    """BACKEND=FLASH (FlashAttention-4's kernels through flex) is refused before anything compiles: on a CPU, on a
    GPU older than Hopper, and where flash_attn.cute is not importable; the other backends pass untouched."""
    import importlib.util

    import torch

    from dflash_dist.config.drafter import DrafterTuning, check_flex_backend

    for opts in (None, {}, {"bwd_num_warps": 4}, {"BACKEND": "TRITON"}):
        check_flex_backend(opts, "cpu")
    with pytest.raises(ConfigError, match="Hopper or newer"):
        check_flex_backend({"BACKEND": "FLASH"}, "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match="Hopper or newer"):
        check_flex_backend({"BACKEND": "FLASH"}, "cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("flash_attn") else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match="flash_attn.cute is not importable"):
        check_flex_backend({"BACKEND": "FLASH"}, "cuda:0")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    check_flex_backend({"BACKEND": "FLASH"}, "cuda:0")           # importable on Hopper: accepted
    # the config takes the string value of BACKEND only, and only flex's backend names
    assert DrafterTuning(flex_kernel_options={"BACKEND": "FLASH"}).flex_kernel_options == {"BACKEND": "FLASH"}
    for bad in ({"BACKEND": "CUTLASS"}, {"bwd_num_warps": "4"}):
        with pytest.raises(ConfigError, match="flex_kernel_options"):
            DrafterTuning(flex_kernel_options=bad)
