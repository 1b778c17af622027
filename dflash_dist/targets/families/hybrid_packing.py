"""Packed rows for hybrid targets: GatedDeltaNet layers restarted at every sample of the packed row.

A GatedDeltaNet layer carries two states along the row: the short causal convolution's window (kernel width - 1
tokens) and the gated delta rule's recurrent state. Packed samples stay independent only if both restart at every
sample boundary. The fast kernels take that boundary directly: flash-linear-attention's ``chunk_gated_delta_rule``
takes ``cu_seqlens`` (cumulative lengths, batch of one row) and causal-conv1d's ``causal_conv1d_fn`` takes
``seq_idx`` (each token's sample index). transformers' GatedDeltaNet forward (5.17 .. 5.25, Qwen3-Next, Qwen3.5,
Qwen3.5-MoE) passes its ``cu_seq_lens_q`` kwarg to the first as ``cu_seqlens`` and its other kwargs to both, filtered
by each kernel's signature; the capture passes these kwargs to the model's forward (``varlen_kwargs``).
transformers' PyTorch fallbacks take neither and would run the states across samples: without both fast kernels
packing is refused (``varlen_problem``).

The capture also proves, on every packed forward, that each linear-attention layer that ran handed the packed row's
boundaries to both kernels (``checked_kernels``), as it proves that every attention layer went through the packed
attention function.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import sys
from typing import Optional

import torch

# module globals of transformers' hybrid modeling that the GatedDeltaNet forward calls by name at prefill ->
# (package of the fast kernel, the kernel argument that carries the sample boundaries)
VARLEN_KERNELS = {
    "torch_chunk_gated_delta_rule": ("fla", "cu_seqlens"),
    "causal_conv1d_fn": ("causal_conv1d", "seq_idx"),
}

# kwarg the capture passes to the forward (transformers' name) -> the kernel argument it reaches
BOUNDARY_KWARGS = {"cu_seq_lens_q": "cu_seqlens", "seq_idx": "seq_idx"}

varlen_calls = {name: 0 for name in VARLEN_KERNELS}
"""Calls of the fast kernels with the packed row's boundaries, outside compiled layers (the capture checks them
against the linear-attention layers that ran)."""

WHY = "so that its recurrent and convolution state restart at every sample"


def linear_layers(layers: Optional[list]) -> list:
    """The GatedDeltaNet modules (``linear_attn``) of the decoder layers, in order."""
    return [layer.linear_attn for layer in layers or [] if hasattr(layer, "linear_attn")]


def missing_packages() -> list[str]:
    """The fast kernels' packages that are not importable (checked before any weights load)."""
    return [pkg for pkg, _ in VARLEN_KERNELS.values() if importlib.util.find_spec(pkg) is None]


def config_problem() -> Optional[str]:
    """Why a hybrid target cannot run packed, from the installed packages alone, or None."""
    missing = missing_packages()
    if not missing:
        return None
    return (f"packed rows need flash-linear-attention's chunk_gated_delta_rule (cu_seqlens) and causal-conv1d's "
            f"causal_conv1d_fn (seq_idx) {WHY}; not importable: {', '.join(missing)}")


def _modeling(linear: torch.nn.Module):
    return sys.modules.get(type(linear).__module__)


def bound_kernel(fn, device_type: Optional[str] = None):
    """The callable transformers' kernel wrapper runs (for inputs on ``device_type`` when given), else ``fn``.

    Two layers of indirection, both read from closures (``targets/fast_path.py`` reads bindings the same way):
    with the ``kernels`` package installed (a dependency of transformers >= 5.25) the module-level name is a
    ``Func`` module whose forward calls the wrapped function (closure ``func``); transformers' wrapper holds the
    package's kernel or the PyTorch fallback (closure ``implementation``) and, since 5.25, the device types the
    package runs on (``supported_devices``): inputs on any other device run the PyTorch fallback."""
    if isinstance(fn, torch.nn.Module):
        try:
            inner = inspect.getclosurevars(type(fn).forward).nonlocals.get("func")
        except (TypeError, ValueError):
            inner = None
        fn = inner if callable(inner) else fn
    try:
        nonlocals = inspect.getclosurevars(fn).nonlocals
    except (TypeError, ValueError):
        return fn
    impl = nonlocals.get("implementation")
    if not callable(impl):
        return fn
    devices = nonlocals.get("supported_devices")
    if device_type is not None and devices is not None and device_type not in devices:
        return nonlocals.get("torch_function", fn)
    return impl


def _source(impl) -> str:
    """The top-level package of a kernel; transformers' PyTorch fallbacks read as ``transformers``."""
    return (getattr(impl, "__module__", None) or "?").split(".")[0]


def varlen_problem(layers: Optional[list]) -> Optional[str]:
    """Why these built layers' GatedDeltaNet modules cannot run packed exactly, or None: both prefill kernels must
    be the fast packages' (bound by transformers, not its PyTorch fallback) and take the boundary argument."""
    linear = linear_layers(layers)
    if not linear:
        return None
    modeling = _modeling(linear[0])
    device = next(iter(linear[0].parameters()), torch.empty(0)).device.type
    for name, (pkg, arg) in VARLEN_KERNELS.items():
        fn = getattr(modeling, name, None)
        if fn is None:
            return (f"{type(linear[0]).__name__}: {getattr(modeling, '__name__', '?')} has no {name} (this "
                    "transformers version's linear-attention layers cannot take packed rows)")
        impl = bound_kernel(fn, device)
        source = _source(impl)
        if source != pkg:
            where = "transformers' PyTorch fallback" if source == "transformers" else source
            why = (f"not importable: {', '.join(missing_packages())}" if missing_packages()
                   else f"{pkg} does not run on {device}" if _source(bound_kernel(fn)) == pkg
                   else "see the fast-path report")
            return (f"{type(linear[0]).__name__} runs {name} on {where} ({why}); packed rows need {pkg}'s kernel, "
                    f"which takes {arg}, {WHY}")
        try:
            params = inspect.signature(impl).parameters
        except (TypeError, ValueError):
            params = {}
        if arg not in params:
            return f"{pkg}'s {getattr(impl, '__name__', name)} takes no {arg} (upgrade {pkg}): packed rows need it {WHY}"
    return None


def varlen_kwargs(lengths: torch.Tensor, device) -> dict:
    """The forward kwargs that carry the packed row's sample boundaries to the GatedDeltaNet kernels, for samples
    of ``lengths`` (the row's pad sample included) concatenated into one row: ``cu_seq_lens_q`` [n+1] int64 on the
    device, ``cu_seqlens_cpu`` (the same on the host: fla reads chunk counts from it without a device sync) and
    ``seq_idx`` [1, T] int32, each token's sample index."""
    lengths = lengths.detach().to("cpu", torch.int64)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu[1:])
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)
    return {"cu_seq_lens_q": cu.to(device), "cu_seqlens_cpu": cu, "seq_idx": seq_idx[None].to(device)}


def _checked(fn, name: str, arg: str, expected: torch.Tensor):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if kwargs.get(arg) is not expected:
            raise RuntimeError(f"packed capture: {name} was called without the packed row's {arg}: the samples' "
                               "states would cross; this transformers version does not forward the boundaries "
                               "(use target.packing=off)")
        if not torch.compiler.is_compiling():
            varlen_calls[name] += 1
        return fn(*args, **kwargs)
    return call


@contextlib.contextmanager
def checked_kernels(layers: list, kwargs: dict):
    """While the packed forward runs: each prefill kernel of the layers' modeling module refuses a call without
    this row's boundary tensor (from ``varlen_kwargs``) and counts the calls that have it."""
    linear = linear_layers(layers)
    modeling = _modeling(linear[0]) if linear else None
    if modeling is None:
        yield
        return
    own = {name: getattr(modeling, name) for name in VARLEN_KERNELS}
    by_arg = {arg: kwargs[kw] for kw, arg in BOUNDARY_KWARGS.items()}
    for name, (_, arg) in VARLEN_KERNELS.items():
        setattr(modeling, name, _checked(own[name], name, arg, by_arg[arg]))
    try:
        yield
    finally:
        for name, fn in own.items():
            setattr(modeling, name, fn)
