"""FP8 targets on CPU: the packaged tiny target saved in each pre-quantized format loads into FP8 linears and
captures; target.quantization=fp8 quantizes on load; the fast-path check names the kernel and require refuses the
dequantize reference; other quantizations, stray FP8 tensors and a replica without weight layouts are refused;
FLOPs and peaks. FP8 replicas themselves: tests/integration/test_replicas.py."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from helpers.fp8_checkpoints import write_fp8_checkpoint
from torch import nn

from dflash_dist.config import ConfigError, TargetConfig
from dflash_dist.targets.fast_path import FastPathError, check_target_fast_path
from dflash_dist.targets.hf import build_target_model, decoder_layers, load_hf_config
from dflash_dist.targets.quant import apply_quantization, quantization_report, shards
from dflash_dist.targets.quant.compare import layer_cosines
from dflash_dist.targets.quant.fp8 import FP8Linear
from dflash_dist.roles.target_rank.capture import FeatureCapture
from dflash_dist.telemetry.flops import target_layers_profile, target_peak_tflops

LAYERS = [1, 3, 6]
N_LINEARS = 8 * 7  # tiny: 8 layers x (q, k, v, o, gate, up, down)


@pytest.fixture(scope="module")
def bf16():
    return build_target_model(TargetConfig(hf_config={"builtin": "tiny"}), "cpu")


@pytest.fixture(scope="module")
def ids():
    torch.manual_seed(0)
    return torch.randint(0, 2048, (2, 48)), torch.tensor([48, 30])


def _features(model, ids):
    cap = FeatureCapture(model, LAYERS, packing=False, compile=False)
    try:
        with torch.inference_mode():
            return cap(*ids).clone()
    finally:
        cap.close()


def _fp8_modules(model):
    return [m for m in model.modules() if isinstance(m, FP8Linear)]


@pytest.mark.parametrize("fmt,detail", [("fine_grained", "fine-grained FP8 e4m3, 128x128 weight blocks"),
                                        ("compressed", "compressed-tensors float8, channel weight scales")])
def test_each_prequantized_format_loads_into_fp8_linears_and_captures(tmp_path, bf16, ids, fmt, detail):
    path = write_fp8_checkpoint(str(tmp_path / fmt), fmt)
    model = build_target_model(TargetConfig(name_or_path=path), "cpu")
    mods = _fp8_modules(model)
    assert len(mods) == N_LINEARS and {m.source for m in mods} == {detail}
    rep = quantization_report(model)
    assert rep["fp8_linears"] == N_LINEARS and rep["kernels"] == ["dequantize"] and rep["fallback"]
    assert detail in rep["summary"] and "dequantize-then-matmul" in rep["summary"]
    # the checkpoint's scales are applied: the dequantized weight is the original to FP8 precision
    q = model.model.layers[2].mlp.down_proj.dequantized_weight(torch.float32)
    w = bf16.model.layers[2].mlp.down_proj.weight
    assert (q - w).abs().max() <= 2 ** -4 * w.abs().max()
    assert not isinstance(model.lm_head, FP8Linear) and torch.equal(model.lm_head.weight, bf16.lm_head.weight)
    cos = layer_cosines(_features(bf16, ids), _features(model, ids), len(LAYERS))
    assert min(c["mean"] for c in cos) > 0.99
    if fmt == "compressed":  # per-channel scales load exactly: the module holds the checkpoint's own tensors
        from safetensors.torch import load_file
        t = load_file(os.path.join(path, "model.safetensors"))
        mod = model.model.layers[0].self_attn.q_proj
        assert torch.equal(mod.weight.view(torch.uint8), t["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8))
        assert torch.equal(mod.scale.flatten(), t["model.layers.0.self_attn.q_proj.weight_scale"].flatten())
    else:
        # one 128x128 block per weight (q, k, v, o: 128 wide) is a per-tensor scale, loaded exactly; the MLP's
        # 384-wide weights have 3 blocks and are requantized per output channel
        assert rep["requantized_per_channel"] == 8 * 3


def test_quantization_fp8_quantizes_a_bf16_target_on_load(bf16, ids):
    model = build_target_model(TargetConfig(hf_config={"builtin": "tiny"}, quantization="fp8"), "cpu")
    assert len(_fp8_modules(model)) == N_LINEARS
    assert isinstance(model.lm_head, nn.Linear) and isinstance(model.model.embed_tokens, nn.Embedding)
    assert "quantized on load" in quantization_report(model)["summary"]
    cos = layer_cosines(_features(bf16, ids), _features(model, ids), len(LAYERS))
    assert min(c["mean"] for c in cos) > 0.99
    assert quantization_report(bf16) is None
    with pytest.raises(ConfigError, match="target.quantization"):
        TargetConfig(hf_config={"builtin": "tiny"}, quantization="int4")


def test_fast_path_names_the_kernel_and_require_refuses_the_reference():
    model = build_target_model(TargetConfig(hf_config={"builtin": "tiny"}, quantization="fp8"), "cpu")
    res = check_target_fast_path(model, "allow", "cpu")
    assert "GEMM: reference: dequantize-then-matmul" in res["summary"] and res["quantization"]["fallback"]
    with pytest.raises(FastPathError, match="without an FP8 GEMM"):
        check_target_fast_path(model, "require", "cpu")
    for m in _fp8_modules(model):  # what CUDA >= 8.9 binds: accepted
        m.kernel = "scaled_mm"
    res = check_target_fast_path(model, "require", "cpu")
    assert "GEMM: torch._scaled_mm (FP8 e4m3, rowwise scales)" in res["summary"]
    _, layers = decoder_layers(model)
    for layer in layers:  # asked for FP8, no FP8 linear left: refused as a fallback to bf16
        layer.mlp.down_proj = nn.Linear(384, 128)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(layer.self_attn, name, nn.Linear(8, 8))
        for name in ("gate_proj", "up_proj"):
            setattr(layer.mlp, name, nn.Linear(8, 8))
    assert quantization_report(model)["fallback"]
    with pytest.raises(FastPathError, match="without an FP8 GEMM"):
        check_target_fast_path(model, "require", "cpu")


def _set_quant(path, qc):
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def test_other_quantizations_and_stray_fp8_tensors_are_refused(tmp_path):
    path = write_fp8_checkpoint(str(tmp_path / "ct"), "compressed")
    _set_quant(path, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(ConfigError, match="quant_method='gptq'"):
        build_target_model(TargetConfig(name_or_path=path), "cpu")
    _set_quant(path, {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}})
    with pytest.raises(ConfigError, match="only 8-bit float weights"):
        build_target_model(TargetConfig(name_or_path=path), "cpu")
    stray = write_fp8_checkpoint(str(tmp_path / "stray"), "fine_grained", extra_fp8=("model.embed_tokens.weight",))
    with pytest.raises(ConfigError, match="model.embed_tokens"):
        build_target_model(TargetConfig(name_or_path=stray), "cpu")


def test_a_replica_whose_load_kept_no_weight_layout_is_refused():
    """FP8 on a replica needs each weight's split (its DTensor placement): plain weights in a replica are
    refused, not quantized as if whole (their outputs would never be summed over the replica)."""
    model = build_target_model(TargetConfig(hf_config={"builtin": "tiny"}), "cpu")
    tcfg = TargetConfig(hf_config={"builtin": "tiny"}, quantization="fp8")
    with pytest.raises(ConfigError, match="keeps no layout"):
        apply_quantization(model, decoder_layers(model)[1], tcfg, None, None, "cpu", replica=True)
    assert not _fp8_modules(model)
    assert shards.layout_of(decoder_layers(model)[1][0].self_attn.o_proj) is None  # a plain weight: whole
    with pytest.raises(ConfigError, match="not this rank's shard"):
        shards.local_slice(torch.zeros(8, 4), shards.Layout("rowwise", 1, 0, 2, None), (8, 3))
    assert shards.local_slice(torch.arange(8.).reshape(2, 4), shards.Layout("rowwise", 1, 1, 2, None),
                              (2, 2)).tolist() == [[2.0, 3.0], [6.0, 7.0]]


def test_flops_count_fp8_linears_and_the_peak_is_the_fp8_one(bf16):
    model = build_target_model(TargetConfig(hf_config={"builtin": "tiny"}, quantization="fp8"), "cpu")
    tc = model.config
    assert target_layers_profile(decoder_layers(model)[1], tc) == target_layers_profile(decoder_layers(bf16)[1], tc)
    for quant, want in ((None, 500.0), ("fp8", 1000.0)):
        tcfg = TargetConfig(hf_config={"builtin": "tiny"}, quantization=quant)
        cfg = SimpleNamespace(target=tcfg, logging=SimpleNamespace(peak_tflops=500.0))
        assert target_peak_tflops(cfg, load_hf_config(tcfg), "cpu") == want
    cfg = SimpleNamespace(target=TargetConfig(hf_config={"builtin": "tiny"}, quantization="fp8"),
                          logging=SimpleNamespace(peak_tflops=None))
    assert target_peak_tflops(cfg, None, "cpu") is None  # no vendor figure on CPU


def test_the_config_check_refuses_the_reference_before_any_weights_load():
    from dflash_dist.targets.fast_path import check_quantization_for_config
    hf_config = load_hf_config(TargetConfig(hf_config={"builtin": "tiny"}))
    fp8 = TargetConfig(hf_config={"builtin": "tiny"}, quantization="fp8", fast_path="require")
    with pytest.raises(FastPathError, match="without an FP8 GEMM"):
        check_quantization_for_config(fp8, hf_config, "cpu")
    fp8.fast_path = "auto"  # allow on CPU
    assert check_quantization_for_config(fp8, hf_config, "cpu") == "dequantize"
    assert check_quantization_for_config(TargetConfig(hf_config={"builtin": "tiny"}, fast_path="require"),
                                         hf_config, "cpu") is None


def _set_scale(path, key, value):
    from safetensors.torch import load_file, save_file
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors[key] = value(tensors[key])
    save_file(tensors, file, metadata={"format": "pt"})


Q = "model.layers.2.self_attn.q_proj.weight"   # [128, 128]
UP = "model.layers.5.mlp.up_proj.weight"       # [384, 128]


@pytest.mark.parametrize("fmt, key, value, needle", [
    ("fine_grained", Q + "_scale_inv", lambda s: -s, "holds -"),
    ("fine_grained", Q + "_scale_inv", lambda s: s * 0, "holds 0.0"),
    ("fine_grained", Q + "_scale_inv", lambda s: s * float("nan"), "holds nan"),
    ("fine_grained", UP + "_scale_inv", lambda s: torch.cat([s, s]), r"shape \(6, 1\) for a \[384, 128\] weight"),
    ("fine_grained", UP + "_scale_inv", lambda s: s.reshape(1, 3), r"the block grid \(3, 1\)"),
    ("fine_grained", Q + "_scale_inv", lambda s: torch.ones(2, 2), r"shape \(2, 2\)"),
    ("compressed", UP + "_scale", lambda s: s[:100], r"shape \(100, 1\) for a \[384, 128\] weight"),
    ("compressed", UP + "_scale", lambda s: torch.ones(7, 200), r"shape \(7, 200\)"),
    ("compressed", UP + "_scale", lambda s: s.abs().neg(), "finite and > 0"),
    ("compressed", UP + "_scale", lambda s: torch.ones_like(s, dtype=torch.int64), "is torch.int64"),
])
def test_fp8_scales_of_the_wrong_shape_or_sign_are_refused(tmp_path, fmt, key, value, needle):
    """A scale that is negative, zero or not finite, of a shape the loader would misread, or of an integer type:
    one ConfigError naming the tensor, before any FP8 linear is built from it."""
    path = write_fp8_checkpoint(str(tmp_path / fmt), fmt)
    _set_scale(path, key, value)
    with pytest.raises(ConfigError, match=needle) as e:
        build_target_model(TargetConfig(name_or_path=path), "cpu")
    assert key in str(e.value) and "\n" not in str(e.value)


def test_scale_shapes_the_loader_reads():
    from dflash_dist.targets.quant.load import check_scale
    for shape in [(), (1,), (384,), (384, 1), (3, 1), (6, 2), (384, 128)]:
        check_scale("p", "k", torch.ones(shape), (384, 128), None)
    check_scale("p", "k", torch.ones(3, 1), (384, 128), (128, 128))
    for shape in [(400, 1), (385,), (1, 384), (2, 3, 1), (384, 129)]:
        with pytest.raises(ConfigError, match="shape"):
            check_scale("p", "k", torch.ones(shape), (384, 128), None)
    with pytest.raises(ConfigError, match=r"the block grid \(3, 1\)"):
        check_scale("p", "k", torch.ones(6, 2), (384, 128), (128, 128))
    with pytest.raises(ConfigError, match="holds inf"):
        check_scale("p", "k", torch.tensor([1.0, float("inf")]), (2, 16), None)
