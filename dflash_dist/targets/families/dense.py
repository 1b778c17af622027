"""Plain dense decoders (Qwen3, Llama 3, Mistral) and the default rules every family entry starts from.

The default rules read the config and the built layers themselves, so a decoder no entry names is still checked:
a layer without softmax attention is never packed, a sliding window or a sink logit the layers pass to attention is
always seen."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from dflash_dist.targets.families.base import TargetFamily, cfg_get

# layer kinds the packed capture runs exactly (document-causal flex attention, per-window masks)
PACKABLE_LAYER_TYPES = ("full_attention", "sliding_attention")


def mlp_width(tc: Any) -> Optional[int]:
    """A dense MLP's width: ``intermediate_size``."""
    return cfg_get(tc, "intermediate_size")


def layer_types_problem(tc: Any, packable: tuple = PACKABLE_LAYER_TYPES) -> Optional[str]:
    """Why the packed capture cannot run these ``layer_types`` (from the config alone), or None."""
    for i, kind in enumerate(cfg_get(tc, "layer_types") or []):
        if kind not in packable:
            return (f"decoder layer {i} is {kind}"
                    + (" (GatedDeltaNet): its recurrent state would run from one packed sample into the next"
                       if kind == "linear_attention" else ""))
    return None


def packing_problem(tc: Any, layers: Optional[list], packable: tuple = PACKABLE_LAYER_TYPES) -> Optional[str]:
    """Every decoder layer must be softmax attention (``self_attn``; full or sliding-window, sinks allowed: exact
    in the packed path); linear-attention layers (``linear_attn``) carry a recurrent state along the row, so packed
    samples would see each other (unless ``packable`` names ``linear_attention``: the hybrid rule, which checks
    their varlen kernels); softcapped and chunked attention are not implemented by the packed function."""
    for i, layer in enumerate(layers or []):
        if hasattr(layer, "linear_attn") and "linear_attention" in packable:
            continue  # the hybrid rule checks its kernels (targets/families/hybrid_packing.py)
        if hasattr(layer, "linear_attn"):
            return (f"decoder layer {i} ({type(layer).__name__}) has linear attention (GatedDeltaNet): its "
                    "recurrent state would run from one packed sample into the next")
        if not hasattr(layer, "self_attn"):
            return f"decoder layer {i} ({type(layer).__name__}) has no self_attn"
    if layers is not None:
        if cfg_get(tc, "attn_logit_softcapping"):
            return "the attention layers softcap their logits (not implemented by the packed flex function)"
        if cfg_get(tc, "attention_chunk_size"):
            return "chunked attention (attention_chunk_size) is not implemented by the packed flex function"
    return layer_types_problem(tc, packable)


def sliding_windows(tc: Any, layers: Optional[list]) -> tuple:
    """Per-layer ``self_attn.sliding_window`` (gpt-oss) and the config's ``sliding_window`` where some layer
    slides (Mistral: no ``layer_types``, unless ``use_sliding_window`` is false), sorted."""
    found = {int(w) for layer in layers or []
             if (w := getattr(getattr(layer, "self_attn", None), "sliding_window", None))}
    w, types = cfg_get(tc, "sliding_window"), cfg_get(tc, "layer_types")
    if w and (not types or "sliding_attention" in types) and cfg_get(tc, "use_sliding_window", True) is not False:
        found.add(int(w))
    return tuple(sorted(found))


def attention_sinks(layers: list) -> bool:
    """A learned sink logit per head on some attention layer (``self_attn.sinks``, gpt-oss)."""
    return any(getattr(getattr(layer, "self_attn", None), "sinks", None) is not None for layer in layers)


DEFAULT = TargetFamily(name="dense", mlp_width=mlp_width, packing_problem=packing_problem,
                       sliding_windows=sliding_windows, attention_sinks=attention_sinks)

FAMILIES = (
    replace(DEFAULT, name="qwen3", model_types=("qwen3", "qwen2")),
    replace(DEFAULT, name="llama", model_types=("llama",)),
    replace(DEFAULT, name="mistral", model_types=("mistral",)),  # sliding_window: the default rule reads it
)
