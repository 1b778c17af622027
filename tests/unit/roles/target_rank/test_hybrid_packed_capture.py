"""Packed capture of hybrid targets (GatedDeltaNet + gated attention) against per-sample rows, and the test that
the recurrent / convolution state never crosses from one packed sample into the next.

CPU: transformers' PyTorch kernels run once per sample behind transformers' own kernel wrapper, posing as fla's
and causal-conv1d's (``helpers.varlen_kernels``): the capture's plumbing (masks per layer kind, positions, the
boundaries reaching both kernels of every layer) is checked exactly in fp32. CUDA with fla and causal-conv1d
installed: the real varlen kernels in bf16."""

import contextlib
import importlib.util

import pytest
import torch

import dflash_dist.targets.families.hybrid_packing as HP
from dflash_dist.config import TargetConfig
from dflash_dist.targets.hf import build_target_model
from dflash_dist.roles.target_rank.capture import FeatureCapture, packing_problem

HAVE_KERNELS = all(importlib.util.find_spec(p) for p in ("fla", "causal_conv1d"))
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not (torch.cuda.is_available() and HAVE_KERNELS), reason="CUDA with fla and causal-conv1d installed"))]
LAYERS = [0, 2, 3, 5]  # linear, linear, full, linear: the last capture stops the forward at layer 5


def _hf(family: str, device: str) -> dict:
    small = device == "cpu"  # CUDA: head dims the fla / causal-conv1d kernels take (64)
    d = dict(vocab_size=1024, hidden_size=64 if small else 256, intermediate_size=128 if small else 512,
             num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16 if small else 64,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16 if small else 64,
             linear_value_head_dim=16 if small else 64, linear_conv_kernel_dim=4, max_position_embeddings=4096,
             tie_word_embeddings=False,
             layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(8)])
    if family == "qwen3_next":
        return dict(d, model_type="qwen3_next", mlp_only_layers=list(range(8)), num_experts=0)
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [1, 1, 0] if small else [4, 2, 2], "mrope_interleaved": True}
    return {"model_type": "qwen3_5_text", **d}


def _model(family: str, device: str):
    model = build_target_model(TargetConfig(hf_config=_hf(family, device), fast_path="allow"), device)
    return model.eval()


def _kernels(model, device, honor=True):
    if device == "cuda":
        return contextlib.nullcontext()
    from helpers.varlen_kernels import bound_varlen_kernels
    return bound_varlen_kernels(model, honor)


def _samples(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 1000, (n,), generator=g) for n in lengths]


def _packed(model, samples, device):
    cap = FeatureCapture(model, LAYERS, packing=True)
    try:
        return cap(torch.cat(samples).to(device), torch.tensor([len(s) for s in samples])), cap.describe()
    finally:
        cap.close()


def _per_sample(model, samples, device):
    cap = FeatureCapture(model, LAYERS)
    try:
        return torch.cat([cap(s[None].to(device), torch.tensor([len(s)])) for s in samples])
    finally:
        cap.close()


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_packed_equals_per_sample(family, device):
    """Three samples in one packed row (lengths not multiples of the kernels' 64-token chunks; 227 tokens, one
    256-token row on CPU, so one compiled flex kernel serves every test here) give each sample's features as its
    own row does."""
    model = _model(family, device)
    samples = _samples([100, 37, 90], seed=1)
    with _kernels(model, device):
        assert packing_problem(model) is None
        got, path = _packed(model, samples, device)
        ref = _per_sample(model, samples, device)
    assert "GatedDeltaNet varlen" in path
    if device == "cpu":
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    else:  # bf16, varlen vs fixed-length kernels
        assert _rel(got, ref) < 2e-2, _rel(got, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_layers_keep_each_gated_delta_net_eager(device):
    """target.compile on a hybrid: the decoder layers compile around their GatedDeltaNet modules, which run eager
    (a graph break, never traced: the proof of the boundaries counts each of their kernel calls, and calls from
    inside a compiled graph are not counted, so a traced module fails the capture); the packed features equal the
    uncompiled ones, on a second row too."""
    model = _model("qwen3_5", device)
    samples = _samples([100, 37, 90], seed=7)
    row, lengths = torch.cat(samples).to(device), torch.tensor([len(s) for s in samples])
    with _kernels(model, device):
        ref, _ = _packed(model, samples, device)
        cap = FeatureCapture(model, LAYERS, packing=True, compile=True)
        try:
            before = dict(HP.varlen_calls)
            got, again = cap(row, lengths), cap(row, lengths)
            assert all(HP.varlen_calls[k] - before[k] == 2 * cap.linear_layers_run for k in before), HP.varlen_calls
            assert "compiled layers: yes, GatedDeltaNet modules eager" in cap.describe()
        finally:
            cap.close()
    assert cap.linear_layers_run == 5  # layers 0-5 run, 3 is full attention
    for out in (got, again):
        if device == "cpu":
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        else:  # bf16: fused norms and MLP round differently from eager (measured 1.3e-2 on an H200)
            assert _rel(out, ref) < 2e-2, _rel(out, ref)


def _second_sample_shift(model, device, n_first=70):
    """How much the packed row's second sample's features change when only the first sample changes."""
    a, a2 = _samples([n_first], seed=2)[0], _samples([n_first], seed=3)[0]
    b = _samples([120], seed=4)[0]
    one, _ = _packed(model, [a, b], device)
    two, _ = _packed(model, [a2, b], device)
    return (one[n_first:].float() - two[n_first:].float()).abs().max().item(), one[n_first:].abs().max().item()


@pytest.mark.parametrize("device", DEVICES)
def test_state_never_crosses_samples(device, monkeypatch):
    """The packed pair's second sample does not change when the first one does; the control runs the same rows
    with the boundaries withheld from the kernels (the check and the proof switched off), and there it changes."""
    model = _model("qwen3_next", device)
    with _kernels(model, device):
        shift, scale = _second_sample_shift(model, device)
    assert shift <= (1e-6 if device == "cpu" else 1e-3 * scale), (shift, scale)
    monkeypatch.setattr(HP, "varlen_kwargs", lambda lengths, device: {})
    monkeypatch.setattr(HP, "checked_kernels", lambda layers, kwargs: contextlib.nullcontext())
    monkeypatch.setattr(FeatureCapture, "_check_linear_calls", lambda self, before, full: None)
    with _kernels(model, device, honor=device == "cuda"):  # CPU: stand-ins that ignore boundaries, as without
        crossed, _ = _second_sample_shift(model, device)
    assert crossed > 100 * max(shift, 1e-4 * scale), (crossed, shift)


def test_packed_labels_run_every_layer():
    """The target's own labels (the full forward: every GatedDeltaNet layer, final norm, lm_head) from a packed row
    equal those of per-sample rows; the proof then counts every linear-attention layer, not only those captured."""
    model = _model("qwen3_next", "cpu")
    samples = _samples([100, 37, 90], seed=6)
    with _kernels(model, "cpu"):
        cap = FeatureCapture(model, LAYERS, packing=True)
        feats, ids, _ = cap.with_labels(torch.cat(samples), torch.tensor([len(x) for x in samples]), top_k=2)
        cap.close()
        ref = FeatureCapture(model, LAYERS)
        per = [ref.with_labels(x[None], torch.tensor([len(x)]), top_k=2) for x in samples]
        ref.close()
    torch.testing.assert_close(feats, torch.cat([p[0] for p in per]), rtol=1e-4, atol=1e-4)
    assert torch.equal(ids, torch.cat([p[1] for p in per]))


def test_a_hybrid_packs_with_its_kernels_bound_on_cuda_or_when_asked():
    """With both kernels bound, target.packing=auto packs a hybrid on CUDA (measured faster there, its layers
    compiled around the GatedDeltaNet modules) and on asks for it anywhere; without them auto stays padded and
    on is refused."""
    from dflash_dist.config import ConfigError
    from dflash_dist.roles.target_rank.capture import build_capture, resolve_compile, resolve_packing
    model = _model("qwen3_5", "cpu")
    tcfg = TargetConfig(hf_config=_hf("qwen3_5", "cpu"), fast_path="allow")
    assert resolve_packing(tcfg, model, "cuda") is False  # transformers' PyTorch fallback bound
    with pytest.raises(ConfigError, match="target.packing=on"):
        resolve_packing(TargetConfig(hf_config=_hf("qwen3_5", "cpu"), fast_path="allow", packing="on"), model, "cuda")
    with _kernels(model, "cpu"):
        assert resolve_packing(tcfg, model, "cuda") is True and resolve_packing(tcfg, model, "cpu") is False
        tcfg.packing = "on"
        assert resolve_packing(tcfg, model, "cuda") is True
        assert resolve_compile(tcfg, model, "cuda") is True and resolve_compile(tcfg, model, "cpu") is False
        cap = build_capture(tcfg, model, LAYERS, "cuda")
        assert cap.packing and cap.compile and cap.pad_multiple == 1
        cap.close()


def test_boundaries_not_forwarded_are_refused(monkeypatch):
    """A linear-attention layer that does not pass the boundaries on (an older transformers) fails the packed
    forward by name instead of letting the state cross samples."""
    model = _model("qwen3_next", "cpu")
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            own = layer.linear_attn.forward

            def dropping(*args, own=own, **kwargs):
                kwargs.pop("seq_idx", None)
                return own(*args, **kwargs)
            monkeypatch.setattr(layer.linear_attn, "forward", dropping)
    with _kernels(model, "cpu"), pytest.raises(RuntimeError, match="causal_conv1d_fn was called without the packed"):
        _packed(model, _samples([40, 30], seed=5), "cpu")
