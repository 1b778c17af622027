"""Stand-ins for the fast GatedDeltaNet kernels on CPU, so the packed hybrid capture's plumbing runs without a GPU.

``bound_varlen_kernels(model)`` binds, for the model's hybrid modeling module, a ``chunk_gated_delta_rule`` that
poses as fla's and a ``causal_conv1d_fn`` that poses as causal-conv1d's, through transformers' own kernel wrapper
(``use_kernel_func_from_hub_with_fallback``, with its filtering of kwargs by the kernel's signature), exactly where
transformers binds the real ones. Each runs transformers' PyTorch reference once per sample of ``cu_seqlens`` /
``seq_idx``, as the real varlen kernels restart their state; ``honor=False`` ignores the boundaries (the PyTorch
fallback's behaviour: the state runs across samples)."""

from __future__ import annotations

import contextlib
import sys
import types

import torch

from dflash_dist.targets.families.hybrid_packing import bound_kernel, linear_layers


def _fake_fla(reference, honor: bool):
    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        run = dict(initial_state=initial_state, output_final_state=output_final_state,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        if cu_seqlens is None or not honor:
            return reference(q, k, v, g, beta, **run)
        assert cu_seqlens_cpu is not None and torch.equal(cu_seqlens_cpu, cu_seqlens.cpu())
        bounds = cu_seqlens_cpu.tolist()
        outs = [reference(*(x[:, a:b] for x in (q, k, v, g, beta)), **run)[0] for a, b in zip(bounds, bounds[1:])]
        return torch.cat(outs, 1), None
    chunk_gated_delta_rule.__module__ = "fla.ops.gated_delta_rule.chunk"
    return chunk_gated_delta_rule


def _fake_conv(reference, honor: bool):
    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                         final_states_out=None, activation=None):
        if seq_idx is None or not honor:
            return reference(x, weight, bias, activation=activation)
        assert seq_idx.dtype == torch.int32 and seq_idx.shape == (x.shape[0], x.shape[2])
        counts = torch.bincount(seq_idx[0].long()).tolist()
        parts = torch.split(x, counts, dim=2)
        return torch.cat([reference(p, weight, bias, activation=activation) for p in parts], 2)
    causal_conv1d_fn.__module__ = "causal_conv1d.causal_conv1d_interface"
    return causal_conv1d_fn


def _wrapped(name: str, package: str, torch_fn, fake):
    """transformers' wrapper around ``torch_fn`` with ``fake`` bound as the package's kernel."""
    from transformers.integrations import hub_kernels
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback
    leaf = "ops.gated_delta_rule" if package == "fla" else None
    mods = {package: types.ModuleType(package)}
    if leaf:
        mods[f"{package}.ops"] = types.ModuleType(f"{package}.ops")
        mods[f"{package}.{leaf}"] = types.ModuleType(f"{package}.{leaf}")
        mods[package].ops = mods[f"{package}.ops"]
        mods[f"{package}.ops"].gated_delta_rule = mods[f"{package}.{leaf}"]
    setattr(mods[f"{package}.{leaf}" if leaf else package], fake.__name__, fake)
    saved = {k: sys.modules.get(k) for k in mods}
    sys.modules.update(mods)
    # transformers >= 5.25 runs a package's kernel only on the device types it lists for the package (CPU inputs
    # take the PyTorch path): the stand-ins run on CPU, so the package is listed for no device while they bind
    devices = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", {})
    listed = devices.pop(package, None)
    try:
        return use_kernel_func_from_hub_with_fallback(name, package)(torch_fn)
    finally:
        if listed is not None:
            devices[package] = listed
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


@contextlib.contextmanager
def bound_varlen_kernels(model, honor: bool = True):
    """While open: the model's GatedDeltaNet prefill kernels are the stand-ins (see the module docstring)."""
    from dflash_dist.targets.hf import decoder_layers
    linear = linear_layers(list(decoder_layers(model)[1]))
    modeling = sys.modules[type(linear[0]).__module__]
    chunk_ref = bound_kernel(modeling.torch_chunk_gated_delta_rule)
    conv_ref = bound_kernel(modeling.causal_conv1d_fn)
    assert chunk_ref.__module__ == modeling.__name__, "the PyTorch reference must be bound when this starts"
    own = {"torch_chunk_gated_delta_rule": modeling.torch_chunk_gated_delta_rule,
           "causal_conv1d_fn": modeling.causal_conv1d_fn}
    modeling.torch_chunk_gated_delta_rule = _wrapped("chunk_gated_delta_rule", "fla", chunk_ref,
                                                     _fake_fla(chunk_ref, honor))
    modeling.causal_conv1d_fn = _wrapped("causal_conv1d_fn", "causal_conv1d", conv_ref, _fake_conv(conv_ref, honor))
    try:
        yield
    finally:
        for name, fn in own.items():
            setattr(modeling, name, fn)
