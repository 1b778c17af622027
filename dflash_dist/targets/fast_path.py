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
  ``implementation`` of the wrapper (the package's function, or the ``torch_*`` fallback), reached through the
  ``kernels`` package's ``Func`` module where that is installed (``hybrid_packing.bound_kernel``);
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
  ``require`` refuses a MoE target whose experts run eager (or the grouped_mm loop) on CUDA (a loop over the
  experts instead of one grouped matmul).
* for FP8 targets (``target.quantization=fp8`` or a pre-quantized checkpoint, ``targets/quant/``), the format and
  the GEMM kernel its FP8 linears run (``torch._scaled_mm`` rowwise, or the dequantize-then-matmul reference).
  ``require`` refuses the reference (CPU, GPUs without FP8 tensor cores) and an FP8 target with no FP8 linear.

What is family-specific (the linear-attention class markers, kernel roles and install hints; the experts' report)
lives with its family in ``targets/families/`` (``hybrid``, ``moe``); this module reports it and applies the policy.
"""

from __future__ import annotations

import importlib
import logging
import sys
from types import ModuleType
from typing import Any, Optional

from dflash_dist.config import ConfigError
from dflash_dist.targets.families import family_for, linear_layer_markers, text_config
from dflash_dist.targets.families.hybrid import INSTALL_HINTS, KERNEL_ROLES, PREFILL_ROLES
from dflash_dist.targets.families.hybrid_packing import bound_kernel
from dflash_dist.targets.families.moe import EXPERTS_FIX, SLOW_EXPERTS, experts_report
from dflash_dist.targets.quant import quantization_report

__all__ = ["FastPathError", "check_target_fast_path", "check_fast_path_for_config", "resolve_policy",
           "INSTALL_HINTS", "HYBRID_LAYER_MARKERS", "experts_report", "attention_report", "SLOW_EXPERTS"]

log = logging.getLogger("dflash_dist")

# the hybrid families' layer markers, kernel roles and install hints and the MoE experts' report live with their
# families (targets/families/); this module reports them and enforces target.fast_path
HYBRID_LAYER_MARKERS = linear_layer_markers()
FP8_FALLBACK = ("the FP8 target's linears run without an FP8 GEMM (the dequantize-then-matmul reference: FP8 GEMMs "
                "need CUDA with compute capability >= 8.9); run on such a GPU, or set target.quantization=null and "
                "load a bf16 checkpoint")


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
    for role, (pkg, names) in KERNEL_ROLES.items():
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
        impl = bound_kernel(fn)
        src = _source(impl, pkg)
        out[role] = {"package": pkg, "where": where, "impl": _qualname(impl), "source": src,
                     "bound": src == pkg or src.startswith("other:")}
    return out


def _kind_entry(cls_name: str, layers: list, bindings: dict, modeling: Optional[ModuleType]) -> dict:
    entry: dict = {"count": len(layers), "layers": layers, "bindings": bindings}
    for pkg, role in PREFILL_ROLES.items():
        b = bindings.get(role)
        entry[pkg] = bool(b and b["bound"])
    if modeling is not None and hasattr(modeling, "is_fast_path_available"):
        entry["is_fast_path_available"] = bool(getattr(modeling, "is_fast_path_available"))
    return entry


# ---------------------------------------------------------------------------------------------- checks

def _attn_impl(config: Any) -> Optional[str]:
    if config is None:
        return None
    text = text_config(config)
    for c in (text, config):
        impl = getattr(c, "_attn_implementation", None)
        if impl:
            return str(impl)
    return None


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
        text = text_config(config)
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
            attn_note: Optional[str] = None, quantization: Optional[dict] = None) -> dict:
    eff = resolve_policy(policy, device_type)
    missing = sorted({pkg for k in kinds.values() for pkg in PREFILL_ROLES if not k[pkg]})
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
    if quantization:
        summary += f"; {quantization['summary']}"
    fp8_fallback = bool(quantization) and quantization["fallback"]
    try:
        import transformers
        tf_version = transformers.__version__
    except Exception:  # pragma: no cover
        tf_version = None
    result = {"policy": policy, "effective_policy": eff, "device_type": device_type, "hybrid": bool(kinds),
              "kinds": kinds, "attn_implementation": attn_impl, "missing": missing, "kernelized": kernelized,
              "transformers": tf_version, "summary": summary, "experts": experts, "attention": attention,
              "quantization": quantization}
    # experts on the eager path are a GPU problem only (on CPU grouped_mm is no faster)
    slow_experts = slow_experts and device_type == "cuda"
    if missing or slow_experts or fp8_fallback:
        lines = [f"  - {INSTALL_HINTS[p]}" for p in missing]
        if fp8_fallback:
            lines.append(f"  - {FP8_FALLBACK}")
        if slow_experts:
            lines.append(f"  - the MoE experts run {experts['implementation']} on CUDA ({experts['detail']}), the "
                         "slow path (a loop over the experts instead of one grouped matmul): " + EXPERTS_FIX)
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
                   attention=attention_report(model, device_type), built=True,
                   quantization=quantization_report(model))


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
    ``attn_implementation``: what the model will be built with (``targets.hf.resolve_attn_implementation``),
    reported when the config does not carry one yet, with ``attn_note`` (how it was chosen) beside it."""
    resolve_policy(policy, device_type)
    text = text_config(hf_config)
    layer_types = list(getattr(text, "layer_types", None) or [])
    linear = [i for i, t in enumerate(layer_types) if "linear" in str(t)]
    kinds = {}
    if linear:
        model_type = getattr(text, "model_type", None) or getattr(hf_config, "model_type", "")
        modeling = _modeling_module(model_type) or _modeling_module(getattr(hf_config, "model_type", ""))
        markers = family_for(hf_config).linear_layer_markers or HYBRID_LAYER_MARKERS
        classes = [n for n in dir(modeling or object()) if any(mk in n for mk in markers)
                   and isinstance(getattr(modeling, n), type)]
        cls = classes[0] if classes else f"{model_type} linear_attention"
        kinds[cls] = _kind_entry(cls, linear, _bindings(None, modeling), modeling)
    return _finish(kinds, _attn_impl(hf_config) or attn_implementation, policy, device_type, attn_note=attn_note)


def check_quantization_for_config(tcfg: Any, hf_config: Any, device_type: str) -> Optional[str]:
    """Before any weights load: the FP8 GEMM kernel an FP8 target (``target.quantization=fp8`` or a pre-quantized
    checkpoint) will bind on ``device_type``, None for a target that is not FP8; the dequantize reference is refused
    here under ``target.fast_path=require``, as the built model's check would refuse it."""
    from dflash_dist.targets.quant import target_is_fp8
    from dflash_dist.targets.quant.fp8 import default_kernel
    if not target_is_fp8(tcfg, hf_config):
        return None
    kernel = default_kernel(device_type)
    if kernel != "scaled_mm" and resolve_policy(tcfg.fast_path, device_type) == "require":
        raise FastPathError(f"target fast path: an FP8 target on {device_type}.\n  - {FP8_FALLBACK}\n  (target.fast_path="
                            f"{tcfg.fast_path}; set target.fast_path=warn or allow to run on the fallback anyway)")
    return kernel
