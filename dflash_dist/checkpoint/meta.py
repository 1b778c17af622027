"""A checkpoint's ``meta.json``: what the trainer records with its weights, and how readers find the drafter in it.

The drafter is recorded once: its model config under ``drafter_config`` (the block size is its ``block_size``,
the only copy) and the rest of its resolved description (variant, backend, compile flags, loss settings) under
``drafter``. Checkpoints written before had a top-level ``block_size`` and no ``drafter``: the readers below
accept both.
"""

from __future__ import annotations

__all__ = ["checkpoint_meta", "meta_block_size", "meta_variant", "meta_model"]


def checkpoint_meta(job, topo, spec, *, cursor: int, counts: dict, final: bool, reason: str) -> dict:
    """The meta of a checkpoint of ``job`` (the drafter's role view) at message ``cursor``; ``spec``: the
    resolved drafter (model/spec.DrafterSpec)."""
    settings = spec.to_meta()
    model = settings.pop("model")
    return {"reason": "final" if final else reason, "cursor": cursor, "total_messages": job.total_messages,
            "num_targets": topo.num_targets, "tensor_parallel": topo.tp, "num_drafters": topo.num_drafters,
            "layer_ids": job.layer_ids, "mask_token_id": job.mask_token_id,
            "drafter_config": model, "drafter": settings,
            "target_config": job.hf_config.to_dict(), "tokenizer": job.tokenizer_path,
            "job_config": job.cfg.to_dict(), "final": final, "counts": dict(counts),
            "chat_template_kwargs": dict(job.cfg.data.chat_template_kwargs or {}),
            "identity": job.identity}


def meta_block_size(meta: dict) -> int:
    """The drafter's block size recorded in ``meta``."""
    dc = meta.get("drafter_config") or {}
    return int(dc["block_size"] if "block_size" in dc else meta["block_size"])


def meta_variant(meta: dict) -> str:
    """The drafter variant recorded in ``meta`` (``dflash`` for checkpoints written before variants)."""
    return str((meta.get("drafter") or {}).get("variant", "dflash"))


def meta_model(meta: dict, backend: str = "sdpa"):
    """The recorded variant's module for ``meta``'s drafter config (weights not loaded)."""
    from dflash_dist.model.drafter import DrafterModelConfig
    from dflash_dist.model.variants import variant_class
    return variant_class(meta_variant(meta))().build(DrafterModelConfig(**meta["drafter_config"]), backend)
