"""What a DFlash2 export's ``config.json`` must say for vLLM (``DFlash2DraftModel``) and SGLang (``DFLASH``) to
load it alike, and the tensors its fields imply, read from the file alone (independent of the module code).

The variant's ``export_problems``, ``config_tensor_shapes`` and ``export_detail`` hooks (variant.py) return these;
the export code asks every variant, so a config that carries any DFlash2 field is checked as DFlash2 whatever its
``architectures`` says (SGLang turns the convolutions on for ``conv_kernel_size`` under any architecture).
"""

from __future__ import annotations

import math

from dflash_dist.config import ConfigError
from dflash_dist.model.variants.dflash2.layers import ARCHITECTURE, DFlash2Settings

__all__ = ["REQUIRED", "WRITTEN", "is_dflash2", "dflash2_problems", "dflash2_settings", "dflash2_tensor_shapes",
           "dflash2_detail"]

REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
"""dflash_config fields vLLM reads with ``[]``: a missing one is a KeyError at load."""

WRITTEN = ("output_multiplier", "final_logit_softcapping")
"""dflash_config fields the engines read with a default; written explicitly so no default decides them."""


def is_dflash2(cfg: dict) -> bool:
    """The export means to be DFlash2: it says so, or carries any DFlash2 field (SGLang turns the conv on for
    ``conv_kernel_size`` under any architecture)."""
    dfc = cfg.get("dflash_config") or {}
    return (ARCHITECTURE in (cfg.get("architectures") or [])
            or any(k in dfc for k in REQUIRED + WRITTEN))


def dflash2_problems(cfg: dict) -> list[str]:
    """What in a DFlash2 ``config.json`` vLLM or SGLang would refuse, read differently from the other, or serve
    silently degraded (empty: none; also empty for a DFlash export)."""
    if not is_dflash2(cfg):
        return []
    out, dfc = [], cfg.get("dflash_config") or {}
    if cfg.get("architectures") != [ARCHITECTURE]:
        out.append(f"architectures={cfg.get('architectures')}: a DFlash2 export needs exactly "
                   f"[{ARCHITECTURE!r}] (vLLM drafts anything else as DFlash, SGLang builds no selector)")
    if cfg.get("model_type") != "qwen3":
        out.append(f"model_type={cfg.get('model_type')!r}: both engines build the DFlash2 drafter from a qwen3 config")
    for key in REQUIRED:
        v = dfc.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            out.append(f"dflash_config.{key}={v!r}: must be an integer >= 1 (vLLM reads it with [], KeyError "
                       "when missing)")
    for key in WRITTEN:
        if key not in dfc:
            out.append(f"no dflash_config.{key} (write it: the engines' default would decide it)")
    mult, cap = dfc.get("output_multiplier", 1.0), dfc.get("final_logit_softcapping")
    if not isinstance(mult, (int, float)) or not 0 < float(mult) < math.inf:
        out.append(f"dflash_config.output_multiplier={mult!r}: must be finite and > 0 (SGLang refuses anything else)")
    if cap is not None and (not isinstance(cap, (int, float)) or not 0 <= float(cap) < math.inf):
        out.append(f"dflash_config.final_logit_softcapping={cap!r}: use a finite cap > 0, or 0 for off")
    for where, holder in (("", cfg), ("dflash_config.", dfc)):
        scale = holder.get("input_embedding_scale", 1.0)
        if scale != 1.0:
            out.append(f"{where}input_embedding_scale={scale!r}: SGLang ignores it and vLLM applies it, so only 1.0 "
                       "(or no field) serves alike")
    for key in ("mask_token_id", "target_layer_ids", "block_size"):
        if dfc.get(key) is None:
            out.append(f"no dflash_config.{key}")
    if "is_causal" not in cfg:
        out.append("no top-level is_causal (vLLM then falls back to dflash_config.causal or the layer kind)")
    if isinstance(dfc.get("conv_kernel_size"), int) and isinstance(dfc.get("block_size"), int) \
            and dfc["conv_kernel_size"] > dfc["block_size"]:
        out.append(f"dflash_config.conv_kernel_size={dfc['conv_kernel_size']} exceeds block_size={dfc['block_size']}")
    group = dfc.get("conv_group_size")
    if isinstance(group, int) and group > 0 and int(cfg.get("hidden_size") or 0) % group:
        out.append(f"dflash_config.conv_group_size={group} does not divide hidden_size={cfg.get('hidden_size')}")
    top_k = dfc.get("selector_top_k")
    if isinstance(top_k, int) and top_k > int(cfg.get("vocab_size") or 0):
        out.append(f"dflash_config.selector_top_k={top_k} exceeds vocab_size={cfg.get('vocab_size')}")
    return out


def dflash2_settings(cfg: dict) -> DFlash2Settings:
    """The DFlash2 settings a DFlash2 ``config.json`` records; training-only fields keep their defaults
    (ConfigError naming the problems when either engine would load it wrongly)."""
    problems = dflash2_problems(cfg)
    if problems:
        raise ConfigError("config.json is not a DFlash2 export both engines load alike: " + "; ".join(problems))
    dfc = cfg["dflash_config"]
    return DFlash2Settings(**{k: dfc[k] for k in REQUIRED + WRITTEN})


def dflash2_tensor_shapes(cfg: dict) -> dict[str, tuple]:
    """The DFlash2 tensors beyond DFlash's a ``config.json`` implies (from its fields, independent of the module
    code): per layer the two convs, then the selector with bare codebooks (no ``.weight``); {} unless DFlash2
    (or when its fields are unusable: :func:`dflash2_problems` names them)."""
    dfc = cfg.get("dflash_config") or {}
    if not is_dflash2(cfg) or any(not isinstance(dfc.get(k), int) or dfc[k] < 1 for k in REQUIRED):
        return {}
    h, v = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    k, groups, r = dfc["conv_kernel_size"], h // dfc["conv_group_size"], dfc["selector_rank"]
    shapes: dict[str, tuple] = {}
    for i in range(int(cfg["num_hidden_layers"])):
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{i}.{conv}.base_kernel"] = (2, k, h)
            shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * k * groups, h)
    shapes.update({"candidate_selector.hidden_projection.weight": (r, h),
                   "candidate_selector.predecessor_codebook": (v, r),
                   "candidate_selector.successor_codebook": (v, r)})
    return shapes


def dflash2_detail(cfg: dict) -> str:
    """The DFlash2 fields of a passing DFlash2 export and how to serve it; '' for any other."""
    if not is_dflash2(cfg):
        return ""
    dfc = cfg["dflash_config"]
    return (f"; DFlash2: conv k={dfc['conv_kernel_size']} g={dfc['conv_group_size']}, selector r="
            f"{dfc['selector_rank']} K={dfc['selector_top_k']}, multiplier {dfc['output_multiplier']}, softcap "
            f"{dfc['final_logit_softcapping']} (vLLM: method dflash, num_speculative_tokens "
            f"{int(dfc['block_size']) - 1}, VLLM_USE_V2_MODEL_RUNNER=1; SGLang: DFLASH)")
