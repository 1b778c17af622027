"""model/spec.py: the drafter resolved once from drafter.* and the target (shape, backend, compile, loss)."""

import pytest

from dflash_dist.config import ConfigError, DrafterConfig
from dflash_dist.model.spec import DrafterSpec, resolve_drafter

TARGET = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
              rope_theta=10000.0, rms_norm_eps=1e-6)


def test_none_means_on_with_flex_resolved_here():
    cpu = resolve_drafter(DrafterConfig(num_layers=2, block_size=8), TARGET, 3, "cpu")
    assert (cpu.backend, cpu.compile_layers, cpu.loss.compiled, cpu.flex_dynamic) == ("sdpa", False, False, False)
    gpu = resolve_drafter(DrafterConfig(num_layers=2, block_size=8), TARGET, 3, "cuda")
    assert (gpu.backend, gpu.compile_layers, gpu.loss.compiled, gpu.flex_dynamic) == ("flex", True, True, True)
    off = resolve_drafter(DrafterConfig(num_layers=2, tuning={"compile_loss": False, "compile_dynamic": False}),
                          TARGET, 3, "cuda")
    assert (off.loss.compiled, off.flex_dynamic) == (False, False)
    assert cpu.block_size == cpu.model.block_size == 8 and cpu.model.num_feature_layers == 3
    assert cpu.loss.chunk_rows == 2048 and cpu.variant == "dflash" and cpu.loss.objective == "decayed_ce"
    # tile options: null = the device's defaults (resolved by the model), {} = inductor's: kept apart
    assert gpu.flex_kernel_options is None
    bare = resolve_drafter(DrafterConfig(num_layers=2, tuning={"flex_kernel_options": {}}), TARGET, 3, "cuda")
    assert bare.flex_kernel_options == {}


def test_meta_round_trip_keeps_block_size_once():
    spec = resolve_drafter(DrafterConfig(num_layers=2, block_size=8, loss={"gamma": 3.0}), TARGET, 3, "cpu")
    meta = spec.to_meta()
    assert "block_size" not in meta and meta["model"]["block_size"] == 8
    assert DrafterSpec.from_meta(meta) == spec


def test_unknown_variant_or_objective_refused_by_key():
    with pytest.raises(ConfigError, match=r"drafter.variant='dflash3'.*dflash"):
        resolve_drafter(DrafterConfig(num_layers=2, variant="dflash3"), TARGET, 3, "cpu")
    with pytest.raises(ConfigError, match=r"drafter.loss.objective='kl'.*decayed_ce"):
        resolve_drafter(DrafterConfig(num_layers=2, loss={"objective": "kl"}), TARGET, 3, "cpu")
    with pytest.raises(ConfigError, match=r"drafter.variant='no_such_module:X': cannot import"):
        resolve_drafter(DrafterConfig(num_layers=2, variant="no_such_module:X"), TARGET, 3, "cpu")
