"""Target families: what the project needs to know about each kind of target model, in one registry.

A family entry (``TargetFamily``) holds the rules both roles ask about a target: whether the DFlash drafter can
mirror it, the drafter's default MLP width, whether its layers can run packed, which sliding windows and attention
sinks its attention layers use, and which of its layers need external kernels. ``family_for(hf_config)`` picks the
entry by ``model_type`` (or, for refused attention kinds, by the config's fields); a target no entry names gets
``DEFAULT``, the plain dense decoder.

Every entry starts from ``DEFAULT``, whose rules read the config and the built layers themselves (so an
unregistered decoder is still checked, never silently misread), and overrides only what differs. One module per
family group, as transformers lays out its models: ``dense`` (the default rules, Qwen3, Llama, Mistral),
``unsupported`` (what the drafter cannot mirror), ``moe``, ``gpt_oss``, ``hybrid`` (GatedDeltaNet).
"""

from __future__ import annotations

from typing import Any

from dflash_dist.targets.families import dense, gpt_oss, hybrid, moe, unsupported
from dflash_dist.targets.families.base import TargetFamily, cfg_get, model_type, text_config

__all__ = ["TargetFamily", "family_for", "text_config", "cfg_get", "model_type", "linear_layer_markers",
           "REGISTRY", "DEFAULT"]

DEFAULT: TargetFamily = dense.DEFAULT
# refused kinds first (found by their fields), then the named families
REGISTRY: tuple = (*unsupported.FAMILIES, *dense.FAMILIES, *moe.FAMILIES, *gpt_oss.FAMILIES, *hybrid.FAMILIES)


def family_for(hf_config: Any) -> TargetFamily:
    """The registry entry of a target's HF config (object or dict; a multimodal wrapper or its text config),
    ``DEFAULT`` for a decoder no entry names."""
    if hf_config is None:
        return DEFAULT
    tc = text_config(hf_config)
    types = {str(cfg_get(tc, "model_type", "") or ""), str(cfg_get(hf_config, "model_type", "") or "")} - {""}
    for fam in REGISTRY:
        if (fam.matches(tc) if fam.matches is not None else bool(types & set(fam.model_types))):
            return fam
    return DEFAULT


def linear_layer_markers() -> tuple:
    """Every registered family's linear-attention class markers (to find such layers in any built model)."""
    return tuple(sorted({m for fam in REGISTRY for m in fam.linear_layer_markers}))
