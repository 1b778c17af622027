"""Targets the DFlash drafter cannot mirror, refused before any weights load.

The drafter is a Qwen3-style model on the target's hidden size, head shape, RoPE, embedding and lm_head; a target
whose attention or heads differ in kind would give a drafter that neither matches its features nor serves as a
DFlash Qwen3 drafter. These entries are found by the config's fields (any model_type), in this order."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dflash_dist.targets.families.base import cfg_get, model_type
from dflash_dist.targets.families.dense import DEFAULT


def _latent_attention(tc: Any) -> bool:
    return bool(cfg_get(tc, "kv_lora_rank") or cfg_get(tc, "q_lora_rank") or cfg_get(tc, "use_mla"))


def _softcapped(tc: Any) -> bool:
    return bool(cfg_get(tc, "final_logit_softcapping") or cfg_get(tc, "attn_logit_softcapping"))


def _scaled_embeddings(tc: Any) -> bool:
    return model_type(tc).startswith("gemma")


FAMILIES = (
    replace(DEFAULT, name="latent_attention", matches=_latent_attention,
            refusal="multi-head latent attention (kv_lora_rank / q_lora_rank, split rope/nope head dims): the "
                    "drafter's attention is GQA with one head_dim and whole-head RoPE"),
    replace(DEFAULT, name="softcapped", matches=_softcapped,
            refusal="logit softcapping: the drafter applies the target's lm_head without it, so its distribution "
                    "would not be the target's"),
    replace(DEFAULT, name="gemma", matches=_scaled_embeddings,
            refusal="scaled input embeddings (embed * sqrt(hidden)): the drafter embeds with the raw table"),
)
