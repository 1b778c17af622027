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

Every target, hybrid or not, also gets in the same report:

* the attention implementation its attention layers dispatch to at call time (``config._attn_implementation``,
  read by ``ALL_ATTENTION_FUNCTIONS.get_interface``) and the function bound to it; on CUDA with sdpa, the SDPA
  backend torch picks for the target's head shape and dtype (``torch._fused_sdp_choice``: flash / efficient /
  cudnn / math);
* for MoE targets, the experts implementation that really runs (:func:`experts_report`). transformers falls back
  from ``grouped_mm`` to ``eager`` silently twice: when the model class cannot set an experts implementation
  (``get_correct_experts_implementation`` swallows the error), and per call when ``_can_use_grouped_mm`` says no
  (it then runs ``transformers::grouped_mm_fallback``, a loop over experts). Both are read off the built model:
  the experts module's ``config._experts_implementation`` and ``_can_use_grouped_mm`` on its own weights.
  ``require`` refuses a MoE target whose experts run eager (or the grouped_mm loop) on CUDA (11x slower
  measured on a Qwen3-30B-A3B shape).
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
           "INSTALL_HINTS", "HYBRID_LAYER_MARKERS", "experts_report", "attention_report", "SLOW_EXPERTS"]

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


# experts implementations that are the slow path on a GPU
SLOW_EXPERTS = ("eager", "grouped_mm->fallback_loop", "module_loop")

EXPERTS_FIX = ("set target.experts_implementation=grouped_mm (transformers' default; needs torch >= 2.9 and an SM80+ "
               "GPU, bf16 weights under torch.compile) or batched_mm, and check that the model class supports "
               "setting it (transformers >= 5 decorates its experts with @use_experts_implementation); "
               "target.fast_path=warn or allow runs the eager experts anyway")


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


# ---------------------------------------------------------------------------------------------- MoE experts

def _is_experts_module(name: str, mod: Any) -> bool:
    """An experts container: transformers 5's fused ``*Experts`` modules, or an ``experts`` ModuleList of
    per-expert MLPs (older modeling code)."""
    return type(mod).__name__.endswith("Experts") or (name.split(".")[-1] == "experts"
                                                      and type(mod).__name__ == "ModuleList")


def _expert_weight(mod: Any):
    for name in ("gate_up_proj", "up_proj", "down_proj"):
        w = getattr(mod, name, None)
        if w is not None and getattr(w, "dim", lambda: 0)() == 3:
            return w
    return None


def _grouped_mm_usable(weight) -> Optional[bool]:
    """transformers' own per-call test (``integrations.moe._can_use_grouped_mm``) on the experts' weight; None
    when this transformers has no such test."""
    try:
        from transformers.integrations.moe import _can_use_grouped_mm
    except Exception:
        return None
    import torch
    x = torch.empty(16, weight.shape[-2] if weight.dim() == 3 else 1, dtype=weight.dtype, device=weight.device)
    offs = torch.zeros(weight.shape[0], dtype=torch.int32, device=weight.device)
    try:
        return bool(_can_use_grouped_mm(x, weight, offs))
    except Exception:
        return None


def experts_report(model: Any) -> Optional[dict]:
    """What the MoE experts of a built model run: {count, classes, implementation, requested, grouped_mm_usable,
    detail}; None for a model without MoE experts. ``implementation``: the resolved name (grouped_mm,
    batched_mm, eager, ...), ``grouped_mm->fallback_loop`` when grouped_mm is configured but transformers'
    per-call check sends it to its loop fallback, ``module_loop`` for an experts class that ignores
    experts_implementation (a per-expert Python loop)."""
    mods = [(n, m) for n, m in model.named_modules() if _is_experts_module(n, m)]
    if not mods:
        return None
    name, first = mods[0]
    classes = sorted({type(m).__name__ for _, m in mods})
    decorated = hasattr(type(first).forward, "__wrapped__") and hasattr(first, "config")
    requested = getattr(getattr(model, "config", None), "_experts_implementation", None)
    out: dict = {"count": len(mods), "classes": classes, "requested": requested, "grouped_mm_usable": None}
    if not decorated:
        out.update(implementation="module_loop",
                   detail=f"{classes[0]}.forward does not dispatch on experts_implementation (per-expert loop)")
        return out
    impl = getattr(first.config, "_experts_implementation", None) or "eager"
    out["implementation"] = impl
    detail = f"{classes[0]} x{len(mods)}: config._experts_implementation={impl}"
    if impl == "grouped_mm":
        w = _expert_weight(first)
        usable = _grouped_mm_usable(w) if w is not None else None
        out["grouped_mm_usable"] = usable
        if usable is False:
            out["implementation"] = "grouped_mm->fallback_loop"
            detail += (f" but transformers' _can_use_grouped_mm is false for its {w.dtype} weights on {w.device} "
                       "(runs transformers::grouped_mm_fallback, a loop over experts)")
        else:
            try:
                import torch
                fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
                detail += f" -> {getattr(fn, '__module__', 'torch')}.{getattr(fn, '__name__', '?')}"
            except Exception:  # pragma: no cover
                pass
    out["detail"] = detail
    return out


def attention_report(model: Any, device_type: str) -> dict:
    """{attn_implementation, function, sdpa_backend}: what the attention layers call (read at call time from
    config._attn_implementation), and on CUDA with sdpa the backend torch picks for the target's shapes."""
    config = getattr(model, "config", None)
    impl = _attn_impl(config)
    out: dict = {"attn_implementation": impl, "function": None, "sdpa_backend": None}
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        fn = ALL_ATTENTION_FUNCTIONS.get(impl) if impl and impl != "eager" else None
        out["function"] = _qualname(fn) if fn is not None else ("eager (the modeling file's eager_attention_forward)"
                                                                 if impl == "eager" else None)
    except Exception:
        pass
    if device_type == "cuda" and impl == "sdpa":
        out["sdpa_backend"] = sdpa_backend(config)
    return out


def sdpa_backend(config: Any, seq_len: int = 1024) -> Optional[str]:
    """The fused SDPA backend torch chooses for a causal [1, heads, seq_len, head_dim] call in the target's
    dtype (``torch._fused_sdp_choice``), on the current CUDA device; None when it cannot be asked."""
    try:
        import torch
        from torch.nn.attention import SDPBackend
        text = getattr(config, "text_config", None) or config
        heads = int(text.num_attention_heads)
        kv = int(getattr(text, "num_key_value_heads", None) or heads)
        d = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        dtype = getattr(text, "dtype", None) or getattr(config, "dtype", None) or torch.bfloat16
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        q = torch.empty(1, heads, seq_len, d, device="cuda", dtype=dtype)
        k = torch.empty(1, kv, seq_len, d, device="cuda", dtype=dtype)
        kw = {"enable_gqa": True} if kv != heads else {}
        choice = torch._fused_sdp_choice(q, k, k, is_causal=True, **kw)
        return SDPBackend(choice).name.lower()
    except Exception as e:  # pragma: no cover - CUDA only
        return f"unknown ({type(e).__name__})"


def _finish(kinds: dict, attn_impl: Optional[str], policy: str, device_type: str, kernelized: bool = False,
            experts: Optional[dict] = None, attention: Optional[dict] = None, built: bool = False,
            attn_note: Optional[str] = None) -> dict:
    eff = resolve_policy(policy, device_type)
    missing = sorted({pkg for k in kinds.values() for pkg in _PREFILL_ROLES if not k[pkg]})
    if kernelized:  # transformers' kernels hub replaced whole layers: the per-function view does not apply
        missing = []
    att = attn_impl
    if attention and attention.get("sdpa_backend"):
        att = f"{attn_impl} (SDPA backend: {attention['sdpa_backend']})"
    elif attn_note:
        att = f"{attn_impl} ({attn_note})"
    if not kinds:
        summary = f"no hybrid layers; attention: {att}"
    else:
        parts = [f"{name} x{k['count']}: fla={'yes' if k['fla'] else 'NO'}, "
                 f"causal-conv1d={'yes' if k['causal_conv1d'] else 'NO'}" for name, k in kinds.items()]
        summary = "; ".join(parts) + f"; attention layers: {att}"
        if missing:
            summary += f" -> linear-attention layers use the PyTorch fallback (missing: {', '.join(missing)})"
    slow_experts = bool(experts) and experts["implementation"] in SLOW_EXPERTS
    if experts:
        summary += f"; MoE experts: {experts['implementation']} ({experts['detail']})"
    elif built:  # the config-only check cannot know: reported again once the model is built
        summary += "; MoE experts: none (dense MLP)"
    try:
        import transformers
        tf_version = transformers.__version__
    except Exception:  # pragma: no cover
        tf_version = None
    result = {"policy": policy, "effective_policy": eff, "device_type": device_type, "hybrid": bool(kinds),
              "kinds": kinds, "attn_implementation": attn_impl, "missing": missing, "kernelized": kernelized,
              "transformers": tf_version, "summary": summary, "experts": experts, "attention": attention}
    # experts on the eager path are a GPU problem only (on CPU grouped_mm is no faster)
    slow_experts = slow_experts and device_type == "cuda"
    if missing or slow_experts:
        lines = [f"  - {INSTALL_HINTS[p]}" for p in missing]
        if slow_experts:
            lines.append(f"  - the MoE experts run {experts['implementation']} on CUDA ({experts['detail']}), the "
                         "slow path (11x slower than grouped_mm measured on a Qwen3-30B-A3B shape): " + EXPERTS_FIX)
        msg = (f"target fast path: {summary}.\n" + "\n".join(lines)
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
                   kernelized=bool(getattr(model, "_use_kernels", False)), experts=experts_report(model),
                   attention=attention_report(model, device_type), built=True)


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
                               attn_implementation: Optional[str] = None, attn_note: Optional[str] = None) -> dict:
    """The same check from the HF config alone (no weights): hybrid iff ``layer_types`` has linear_attention;
    bindings read from the model type's modeling module (the binding is decided when transformers imports it).
    ``attn_implementation``: what the model will be built with (``model.hf.resolve_attn_implementation``),
    reported when the config does not carry one yet, with ``attn_note`` (how it was chosen) beside it."""
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
    return _finish(kinds, _attn_impl(hf_config) or attn_implementation, policy, device_type, attn_note=attn_note)
