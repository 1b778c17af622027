"""Target fast paths: are the hybrid (GatedDeltaNet) layers of the target bound to their fast kernels?

Qwen3-Next and Qwen3.5 mix full-attention layers with GatedDeltaNet linear-attention layers. Their prefill
needs two external kernels, and transformers falls back to slow (but correct) PyTorch code when either is
missing, with one log line that is easy to miss:

* ``chunk_gated_delta_rule`` (and ``fused_recurrent_gated_delta_rule`` for decoding) from
  flash-linear-attention (``import fla``);
* ``causal_conv1d_fn`` (and ``causal_conv1d_update``) from causal-conv1d.

How transformers binds them differs by version, and both ways are read here:

* transformers >= 5.2x: module-level functions of ``modeling_qwen3_next`` / ``modeling_qwen3_5`` wrapped by
  ``use_kernel_func_from_hub_with_fallback(name, package)``; the chosen callable is the closure variable
  ``implementation`` of the wrapper (the package's function, or the ``torch_*`` fallback);
* older transformers: module globals ``chunk_gated_delta_rule`` / ``causal_conv1d_fn`` (None when the package
  is missing, ``is_fast_path_available``) copied onto each layer (``self.chunk_gated_delta_rule`` ...).

``check_target_fast_path(model, policy, device_type)`` inspects a built model;
``check_fast_path_for_config(hf_config, policy, device_type)`` does the same from the HF config alone, before
any weights load, so a missing kernel fails every rank in seconds. Policy: ``require`` raises
``FastPathError`` (with how to install), ``warn`` logs a warning, ``allow`` only reports; ``auto`` is require
on CUDA and allow on CPU.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from types import ModuleType
from typing import Any, Optional

from dflash_dist.config import ConfigError

__all__ = ["FastPathError", "check_target_fast_path", "check_fast_path_for_config", "resolve_policy",
           "INSTALL_HINTS", "HYBRID_LAYER_MARKERS"]

log = logging.getLogger("dflash_dist")

# class-name markers of linear-attention layers that need external kernels
HYBRID_LAYER_MARKERS = ("GatedDeltaNet",)

# role -> (package import name, names to look for: layer attribute / module global, in order)
_ROLES: dict[str, tuple[str, tuple[str, ...]]] = {
    "chunk_gated_delta_rule": ("fla", ("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule")),
    "fused_recurrent_gated_delta_rule": ("fla", ("recurrent_gated_delta_rule", "fused_recurrent_gated_delta_rule",
                                                 "torch_recurrent_gated_delta_rule")),
    "causal_conv1d_fn": ("causal_conv1d", ("causal_conv1d_fn",)),
    "causal_conv1d_update": ("causal_conv1d", ("causal_conv1d_update", "torch_causal_conv1d_update")),
}
# what the target's prefill (a forward without cache) calls: these decide "bound"
_PREFILL_ROLES = {"fla": "chunk_gated_delta_rule", "causal_conv1d": "causal_conv1d_fn"}

INSTALL_HINTS = {
    "fla": ("flash-linear-attention is missing: `pip install flash-linear-attention` (imports as `fla`; needs "
            "triton and a GPU). Without it the GatedDeltaNet layers run transformers' PyTorch reference "
            "(chunk_gated_delta_rule), several times slower."),
    "causal_conv1d": ("causal-conv1d is missing: it is source-only on the registry; build it for your GPU against "
                      "the installed torch: `pip download --no-deps --no-binary=:all: --no-build-isolation "
                      "causal-conv1d==1.7.0 -d DIR`, then `bash docker/build_causal_conv1d.sh DIR/causal_conv1d-1.7.0.tar.gz "
                      "TARGET_DIR sm_90` and put TARGET_DIR on PYTHONPATH (docker/Dockerfile does the same for its image), or "
                      "`pip install causal-conv1d --no-build-isolation` (builds every architecture: slow). "
                      "Measured: 1.16x faster prefill of a Qwen3-Next-shaped target with it."),
}


class FastPathError(ConfigError):
    """A hybrid target would run its linear-attention layers on the slow PyTorch fallback. A ConfigError, so
    ``train._hydra_main`` reports it like any configuration error (message, exit 2)."""


def resolve_policy(policy: str, device_type: str) -> str:
    if policy not in ("auto", "require", "warn", "allow"):
        raise ValueError(f"fast_path policy {policy!r}: use auto, require, warn or allow")
    if policy == "auto":
        return "require" if device_type == "cuda" else "allow"
    return policy


# ---------------------------------------------------------------------------------------------- binding

def _implementation(fn: Any) -> Any:
    """The callable a transformers kernel wrapper dispatches to (its closure's ``implementation``), else fn."""
    if fn is None or not callable(fn):
        return fn
    try:
        nonlocals = inspect.getclosurevars(fn).nonlocals
    except (TypeError, ValueError):
        return fn
    impl = nonlocals.get("implementation")
    return impl if callable(impl) else fn


def _source(impl: Any, package: str) -> str:
    if impl is None:
        return "none"
    mod = getattr(impl, "__module__", None) or ""
    top = mod.split(".")[0]
    if top == package:
        return package
    if top == "transformers" or getattr(impl, "__name__", "").startswith("torch_"):
        return "torch"
    return f"other:{mod}"  # e.g. a hub kernel (kernels package): a fast kernel, not the fallback


def _qualname(impl: Any) -> Optional[str]:
    if impl is None:
        return None
    return f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', getattr(impl, '__name__', '?'))}"


def _bindings(layer: Any, modeling: Optional[ModuleType]) -> dict:
    """role -> {package, where, impl, source, bound} for one linear-attention layer (or its modeling module)."""
    out = {}
    for role, (pkg, names) in _ROLES.items():
        fn, where, found = None, None, False
        if layer is not None:
            for n in names:
                if n in vars(layer):  # older transformers copy the chosen function onto the layer
                    fn, where, found = getattr(layer, n), f"self.{n}", True
                    break
        if not found and modeling is not None:
            for n in names:
                if hasattr(modeling, n):
                    fn, where, found = getattr(modeling, n), f"{modeling.__name__}.{n}", True
                    break
        if not found:
            continue
        impl = _implementation(fn)
        src = _source(impl, pkg)
        out[role] = {"package": pkg, "where": where, "impl": _qualname(impl), "source": src,
                     "bound": src == pkg or src.startswith("other:")}
    return out


def _kind_entry(cls_name: str, layers: list, bindings: dict, modeling: Optional[ModuleType]) -> dict:
    entry: dict = {"count": len(layers), "layers": layers, "bindings": bindings}
    for pkg, role in _PREFILL_ROLES.items():
        b = bindings.get(role)
        entry[pkg] = bool(b and b["bound"])
    if modeling is not None and hasattr(modeling, "is_fast_path_available"):
        entry["is_fast_path_available"] = bool(getattr(modeling, "is_fast_path_available"))
    return entry


# ---------------------------------------------------------------------------------------------- checks

def _attn_impl(config: Any) -> Optional[str]:
    if config is None:
        return None
    text = getattr(config, "text_config", None) or config
    for c in (text, config):
        impl = getattr(c, "_attn_implementation", None)
        if impl:
            return str(impl)
    return None


def _finish(kinds: dict, attn_impl: Optional[str], policy: str, device_type: str, kernelized: bool = False
            ) -> dict:
    eff = resolve_policy(policy, device_type)
    missing = sorted({pkg for k in kinds.values() for pkg in _PREFILL_ROLES if not k[pkg]})
    if kernelized:  # transformers' kernels hub replaced whole layers: the per-function view does not apply
        missing = []
    if not kinds:
        summary = f"no hybrid layers (dense target); attention: {attn_impl}"
    else:
        parts = [f"{name} x{k['count']}: fla={'yes' if k['fla'] else 'NO'}, "
                 f"causal-conv1d={'yes' if k['causal_conv1d'] else 'NO'}" for name, k in kinds.items()]
        summary = "; ".join(parts) + f"; attention layers: {attn_impl}"
        if missing:
            summary += f" -> linear-attention layers use the PyTorch fallback (missing: {', '.join(missing)})"
    try:
        import transformers
        tf_version = transformers.__version__
    except Exception:  # pragma: no cover
        tf_version = None
    result = {"policy": policy, "effective_policy": eff, "device_type": device_type, "hybrid": bool(kinds),
              "kinds": kinds, "attn_implementation": attn_impl, "missing": missing, "kernelized": kernelized,
              "transformers": tf_version, "summary": summary}
    if missing:
        msg = (f"target fast path: {summary}.\n" + "\n".join(f"  - {INSTALL_HINTS[p]}" for p in missing)
               + f"\n  (target.fast_path={policy}; set target.fast_path=warn or allow to run on the fallback anyway)")
        result["message"] = msg
        if eff == "require":
            raise FastPathError(msg)
        if eff == "warn":
            log.warning(msg)
        else:
            log.info(msg)
    else:
        log.info("target fast path: %s", summary)
    return result


def check_target_fast_path(model: Any, policy: str, device_type: str) -> dict:
    """Report, per hybrid layer kind of a built HF model, whether fla and causal-conv1d kernels are bound, and the
    attention implementation of its attention layers; enforce ``policy`` (see the module docstring)."""
    resolve_policy(policy, device_type)
    found: dict[str, list] = {}
    first: dict[str, Any] = {}
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if any(mk in cls for mk in HYBRID_LAYER_MARKERS):
            idx = getattr(mod, "layer_idx", None)
            found.setdefault(cls, []).append(idx if idx is not None else name)
            first.setdefault(cls, mod)
    kinds = {}
    for cls, layers in found.items():
        layer = first[cls]
        modeling = sys.modules.get(type(layer).__module__)
        kinds[cls] = _kind_entry(cls, layers, _bindings(layer, modeling), modeling)
    return _finish(kinds, _attn_impl(getattr(model, "config", None)), policy, device_type,
                   kernelized=bool(getattr(model, "_use_kernels", False)))


def _modeling_module(model_type: str) -> Optional[ModuleType]:
    try:
        from transformers.models.auto.configuration_auto import model_type_to_module_name
        name = model_type_to_module_name(model_type)
    except Exception:
        name = model_type.replace("-", "_")
    for mod_name in (name, name.removesuffix("_text")):
        try:
            return importlib.import_module(f"transformers.models.{mod_name}.modeling_{mod_name}")
        except Exception:
            continue
    return None


def check_fast_path_for_config(hf_config: Any, policy: str, device_type: str,
                               attn_implementation: Optional[str] = None) -> dict:
    """The same check from the HF config alone (no weights): hybrid iff ``layer_types`` has linear_attention;
    bindings read from the model type's modeling module (the binding is decided when transformers imports it).
    ``attn_implementation``: what the model will be built with (``target.attn_implementation``), reported
    when the config does not carry one yet."""
    resolve_policy(policy, device_type)
    text = getattr(hf_config, "text_config", None) or hf_config
    layer_types = list(getattr(text, "layer_types", None) or [])
    linear = [i for i, t in enumerate(layer_types) if "linear" in str(t)]
    kinds = {}
    if linear:
        model_type = getattr(text, "model_type", None) or getattr(hf_config, "model_type", "")
        modeling = _modeling_module(model_type) or _modeling_module(getattr(hf_config, "model_type", ""))
        classes = [n for n in dir(modeling or object()) if any(mk in n for mk in HYBRID_LAYER_MARKERS)
                   and isinstance(getattr(modeling, n), type)]
        cls = classes[0] if classes else f"{model_type} linear_attention"
        kinds[cls] = _kind_entry(cls, linear, _bindings(None, modeling), modeling)
    return _finish(kinds, _attn_impl(hf_config) or attn_implementation, policy, device_type)
