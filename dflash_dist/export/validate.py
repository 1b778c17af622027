"""An export directory is data from elsewhere: check its files before anything is opened, built or allocated.

:func:`check_export_dir` checks ``config.json`` (sizes typed and bounded, a variant's sizes by its
``export_size_fields``), the safetensors header against the file and the provenance file ``dflash_dist_meta.json``
against its schema, with the value checks of checkpoint/validate.py (each raises
:class:`~dflash_dist.checkpoint.safe_io.CheckpointError` naming the file and the field).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from dflash_dist.checkpoint.safe_io import check_entries, check_model_size, fail, read_json
from dflash_dist.checkpoint.tensor_types import float_header
from dflash_dist.checkpoint.validate import (
    BOUNDS,
    _bool,
    _drafter_settings,
    _layer_ids,
    _nonneg,
    _obj,
    _opt_str,
    check_drafter_config,
    check_section,
    check_sizes,
    check_type,
    count,
    local_location,
    size,
)

__all__ = ["check_export_dir", "SIDE_SCHEMA"]


def _variant_export_fields() -> dict[str, int]:
    """The config.json fields of the variants' exports to bound (their ``export_size_fields``), with the bound."""
    from dflash_dist.model.variants import registered_variants
    return {f: v.size_bounds[f.rsplit(".", 1)[-1]] for v in registered_variants() for f in v.export_size_fields}


def _optional(check):
    """``check``, or nothing for a null value."""
    return lambda file, field, v: None if v is None else check(file, field, v)


def _check_target(file: str, field: str, t: Any) -> None:
    from dflash_dist.config import TargetConfig
    check_section(file, field, t, TargetConfig)
    check_sizes(file, f"{field}.hf_config.", t.get("hf_config") or {})
    check_model_size(file, f"{field}.hf_config", t.get("hf_config") or {})


def _check_data(file: str, field: str, d: Any) -> None:
    from dflash_dist.config import DataConfig
    check_section(file, field, d, DataConfig)


# the keys of an export's dflash_dist_meta.json (export/write.py _side_meta) and the check of each
SIDE_SCHEMA = {
    "format": _opt_str, "source_checkpoint": _opt_str, "tokenizer_source": local_location, "dtype": _opt_str,
    "step": _optional(_nonneg), "cursor": _optional(_nonneg), "final": _optional(_bool), "layer_ids": _layer_ids,
    "mask_token_id": _nonneg, "block_size": size, "drafter_config": check_drafter_config, "drafter": _drafter_settings,
    "target": _optional(_check_target), "data": _optional(_check_data), "chat_template_kwargs": _obj,
}
_EXPORT_INTS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "num_hidden_layers", "vocab_size", "max_position_embeddings", "block_size", "sliding_window",
                "num_target_layers", "target_hidden_size")
# the other config.json fields load_export reads, with their types
_EXPORT_TYPES = {
    "rms_norm_eps": Optional[float], "rope_theta": Optional[float], "initializer_range": Optional[float],
    "hidden_act": Optional[str], "layer_types": Optional[list[str]], "rope_parameters": Optional[dict],
    "rope_scaling": Optional[dict], "use_sliding_window": Optional[bool], "is_causal": Optional[bool],
    "attention_bias": Optional[bool], "eagle_aux_hidden_state_layer_ids": Optional[list[int]],
    "architectures": Optional[list[str]], "auto_map": Optional[dict], "dflash_config": Optional[dict],
}
_EXPORT_BOUND = {"num_target_layers": "num_hidden_layers", "target_hidden_size": "hidden_size"}


def check_export_dir(path: str, side_name: str = "dflash_dist_meta.json") -> tuple[dict, dict]:
    """(config.json, {name: (dtype, shape)} of model.safetensors) of an export directory: no entry a symlink
    out of it, config.json's sizes typed and bounded, the safetensors header against the file, the
    provenance file (ours only) against its schema."""
    check_entries(path)
    cfg = read_json(path, "config.json")
    file = os.path.join(path, "config.json")
    for k in ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers", "vocab_size"):
        if k not in cfg:
            raise fail(file, k, "missing")
    check_model_size(file, "num_hidden_layers", cfg)
    for k in _EXPORT_INTS:
        if cfg.get(k) is not None:
            count(file, k, cfg[k], 1, BOUNDS[_EXPORT_BOUND.get(k, k)])
    variant_fields = _variant_export_fields()
    for k, bound in variant_fields.items():          # a variant's top-level sizes
        if "." not in k and cfg.get(k) is not None:
            count(file, k, cfg[k], 1, bound)
    for k, tp in _EXPORT_TYPES.items():
        if k in cfg:
            check_type(file, k, cfg[k], tp)
    dfc = cfg.get("dflash_config") or {}
    _obj(file, "dflash_config", dfc)
    check_type(file, "dflash_config.mask_token", dfc.get("mask_token"), Optional[str])
    if "target_layer_ids" in dfc:
        _layer_ids(file, "dflash_config.target_layer_ids", dfc["target_layer_ids"])
    for k, bound in variant_fields.items():          # a variant's dflash_config sizes
        key = k.removeprefix("dflash_config.")
        if k.startswith("dflash_config.") and dfc.get(key) is not None:
            count(file, k, dfc[key], 1, bound)
    for k in ("mask_token_id", "block_size"):
        if dfc.get(k) is not None:
            count(file, f"dflash_config.{k}", dfc[k], 0 if k == "mask_token_id" else 1, BOUNDS["block_size"]
                  if k == "block_size" else BOUNDS["vocab_size"])
    header = float_header(os.path.join(path, "model.safetensors"))
    if os.path.lexists(os.path.join(path, side_name)):
        side = read_json(path, side_name)
        side_file = os.path.join(path, side_name)
        for k, v in side.items():
            if k not in SIDE_SCHEMA:
                raise fail(side_file, k, f"unknown key (known: {', '.join(sorted(SIDE_SCHEMA))})")
            SIDE_SCHEMA[k](side_file, k, v)
    return cfg, header
