"""An export directory as the loaders read it, and :func:`load_export`, which reads it back.

What an export of ours must carry for every loader (:func:`export_problems`, also ``dflash-doctor --export DIR``),
the tensors its ``config.json`` implies (:func:`expected_tensor_shapes`), the drafter config it describes
(:func:`drafter_config_from_export`, refusing attention settings a loader would read differently from how the
drafter was trained) and the drafter itself (:func:`load_export`, ours or a z-lab release with default RoPE).
``export/write.py`` writes such directories and checks them with the same functions before renaming them
into place.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

import torch

from dflash_dist.export.serving import MODELING_NAME
from dflash_dist.checkpoint.store import CheckpointError
from dflash_dist.config import ConfigError
from dflash_dist.model.drafter import DFlashDrafter, DrafterModelConfig
from dflash_dist.model.rope import drafter_rope_parameters
from dflash_dist.model.variants import VARIANTS, DFlash, registered_variants, variant_of_export

log = logging.getLogger(__name__)


__all__ = ["load_export", "export_problems", "drafter_config_from_export", "expected_tensor_shapes",
           "validate_export_tensors", "validate_variant_tensors", "safetensors_shapes", "checked_export",
           "ExportError", "CheckpointInputError", "META_NAME", "MODELING_NAME", "config_tensor_shapes",
           "check_variant_fields", "nonfinite_tensors"]


META_NAME = "dflash_dist_meta.json"


def _variant_problems(cfg: dict) -> list[str]:
    """Every registered variant's problems with ``cfg`` (each answers only for a config of its own)."""
    return [p for v in registered_variants() for p in v.export_problems(cfg)]


def config_tensor_shapes(cfg: dict) -> dict[str, tuple]:
    """The tensors beyond DFlash's that ``cfg``'s fields imply (every registered variant's
    ``config_tensor_shapes``; {} for a DFlash export)."""
    out: dict[str, tuple] = {}
    for v in registered_variants():
        out.update(v.config_tensor_shapes(cfg))
    return out


def check_variant_fields(cfg: dict, prefix: str) -> None:
    """ExportError (``prefix``, then the problems) when a variant's fields in ``cfg`` are not what the serving
    engines load alike."""
    for v in registered_variants():
        problems = v.export_problems(cfg)
        if problems:
            raise ExportError(prefix.format(title=v.title) + "; ".join(problems))


class ExportError(ValueError):
    """The checkpoint or export directory cannot be used; the message says why."""


class CheckpointInputError(ExportError, CheckpointError):
    """A checkpoint or export whose files do not check out (checkpoint/validate.py): an ExportError for export's
    callers, a CheckpointError for the command lines' ``checkpoint error:`` line."""


def export_problems(cfg: dict, path: Optional[str] = None) -> list[str]:
    """What an export of ours must carry for every loader and does not (empty: complete). ``path``: also check
    the modeling file is there."""
    out = []
    theta = cfg.get("rope_theta")
    params = cfg.get("rope_parameters")
    if theta is None:
        out.append("no top-level rope_theta (transformers 4.x Qwen3Config would use 10000)")
    if "rope_scaling" not in cfg:
        out.append("no top-level rope_scaling (transformers 4.x)")
    if not isinstance(params, dict) or params.get("rope_theta") is None:
        out.append("no rope_parameters.rope_theta (transformers 5, vLLM, SGLang)")
    elif theta is not None and float(params["rope_theta"]) != float(theta):
        out.append(f"rope_theta {theta} != rope_parameters.rope_theta {params['rope_theta']}")
    dfc = cfg.get("dflash_config") or {}
    mt = dfc.get("mask_token")
    if not isinstance(mt, str) or not mt:
        out.append("no dflash_config.mask_token (SGLang resolves the mask token by its string, default <|MASK|>)")
    if dfc.get("mask_token_id") is None:
        out.append("no dflash_config.mask_token_id")
    ids = dfc.get("target_layer_ids") or []
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        out.append("no eagle_aux_hidden_state_layer_ids (older vLLM reads only it for the capture layers)")
    elif [int(i) for i in aux] != [int(i) + 1 for i in ids]:
        out.append(f"eagle_aux_hidden_state_layer_ids {aux} != target_layer_ids + 1 ({[int(i) + 1 for i in ids]})")
    variant = variant_of_export(cfg, by_fields=True)
    auto = variant.auto_model if variant is not None else DFlash.auto_model
    if (cfg.get("auto_map") or {}).get("AutoModel") != auto:
        out.append(f"auto_map.AutoModel is not {auto!r} (AutoModel(trust_remote_code) would build "
                   "a plain Qwen3Model)")
    if path is not None and not os.path.exists(os.path.join(path, MODELING_NAME)):
        out.append(f"no {MODELING_NAME} (auto_map names it)")
    if cfg.get("is_causal") is not False:
        out.append("is_causal is not false (vLLM and the z-lab model make sliding layers causal unless told)")
    return out + _variant_problems(cfg)


def expected_tensor_shapes(cfg: dict) -> dict[str, tuple]:
    """Every tensor name and shape an exported ``config.json`` implies (independent of the module code)."""
    h = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    d = int(cfg.get("head_dim") or h // heads)
    inter = int(cfg["intermediate_size"])
    n_feat = len((cfg.get("dflash_config") or {}).get("target_layer_ids") or [])
    target_h = int(cfg.get("target_hidden_size") or h)
    shapes: dict[str, tuple] = {
        "fc.weight": (h, n_feat * target_h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(int(cfg["num_hidden_layers"])):
        p = f"layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * d, h),
            p + "self_attn.k_proj.weight": (kv * d, h),
            p + "self_attn.v_proj.weight": (kv * d, h),
            p + "self_attn.o_proj.weight": (h, heads * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    return shapes


def validate_export_tensors(tensors: dict, cfg: dict) -> None:
    """Raise ExportError unless ``tensors`` has exactly the names and shapes ``cfg`` implies."""
    want = {**expected_tensor_shapes(cfg), **config_tensor_shapes(cfg)}   # a variant's, from its fields
    have = {k: tuple(v.shape) for k, v in tensors.items()}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    wrong = sorted(k for k in set(want) & set(have) if want[k] != have[k])
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"missing {missing[:6]}{' ...' if len(missing) > 6 else ''}")
        if extra:
            parts.append(f"unexpected {extra[:6]}{' ...' if len(extra) > 6 else ''}")
            parts += [h for v in registered_variants() for h in v.tensor_hints(extra)]
        if wrong:
            parts.append("wrong shapes " + ", ".join(f"{k}: {have[k]} != {want[k]}" for k in wrong[:6]))
        raise ExportError("drafter tensors do not match the exported config: " + "; ".join(parts))


def validate_variant_tensors(tensors: dict, cfg: dict) -> None:
    """:func:`validate_export_tensors` for DFlash's tensors, and the names and shapes of the variant's own (its
    ``extra_tensor_shapes``; the variant ``architectures`` names) for the rest."""
    variant = variant_of_export(cfg)
    known = config_tensor_shapes(cfg)   # checked by validate_export_tensors from the config's fields
    extra = {k: v for k, v in (variant.extra_tensor_shapes(cfg) if variant is not None else {}).items()
             if k not in known}
    validate_export_tensors({k: v for k, v in tensors.items() if k not in extra}, cfg)
    have = {k: tuple(v.shape) for k, v in tensors.items() if k in extra}
    if have != {k: tuple(s) for k, s in extra.items()}:
        raise ExportError(f"the {variant.name} tensors do not match the exported config: have {have}, want {extra}")


def safetensors_shapes(path: str) -> dict[str, Any]:
    """{name: an object with the tensor's ``.shape``} of a safetensors file, from its header (no tensor is read),
    for :func:`validate_export_tensors`."""
    from dflash_dist.checkpoint.safe_io import safetensors_header
    return {k: _Shape(shape) for k, (_, shape) in safetensors_header(path).items()}


def nonfinite_tensors(path: str) -> list[str]:
    """Names of the tensors of a safetensors file holding NaN or inf (one tensor in memory at a time)."""
    from safetensors import safe_open
    bad = []
    with safe_open(path, framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad.append(name)
    return bad


class _Shape:
    def __init__(self, shape):
        self.shape = tuple(shape)


def checked_export(path: str) -> tuple[dict, dict]:
    """(config.json, safetensors header) of an export whose files check out (export/validate.py), else
    :class:`CheckpointInputError` naming the file and field."""
    from dflash_dist.export.validate import check_export_dir
    try:
        return check_export_dir(path, META_NAME)
    except CheckpointError as e:
        raise CheckpointInputError(f"export {path} is unusable: {e}") from None


def drafter_config_from_export(cfg: dict) -> DrafterModelConfig:
    """DrafterModelConfig of an exported ``config.json`` (ours or z-lab's)."""
    dfc = cfg.get("dflash_config") or {}
    layer_ids = dfc.get("target_layer_ids")
    if not layer_ids:
        raise ExportError("config.json has no dflash_config.target_layer_ids")
    block_size = dfc.get("block_size", cfg.get("block_size"))
    if block_size is None:
        raise ExportError("config.json has no block_size (top level or dflash_config)")
    layer_types, window = _attention_layout(cfg)
    if cfg.get("attention_bias"):
        raise ExportError("attention_bias=true is not supported by DFlashDrafter")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    if int(cfg.get("target_hidden_size") or hidden) != hidden:
        raise ExportError(f"target_hidden_size={cfg['target_hidden_size']} != hidden_size={hidden}: "
                          "DFlashDrafter needs the target's hidden size")
    return DrafterModelConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_feature_layers=len(layer_ids),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_parameters(cfg)["rope_theta"],
        rope_parameters=_rope_parameters(cfg),
        block_size=int(block_size),
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        initializer_range=float(cfg.get("initializer_range", 0.02) or 0.02),
        layer_types=layer_types,
        sliding_window=window,
        variant_settings=_variant_settings(cfg),
    )


def _variant_settings(cfg: dict) -> Optional[dict]:
    variant = variant_of_export(cfg)   # a config naming no variant is DFlash's
    return variant.settings_from_export(cfg) if variant is not None else None


def _export_variant(cfg: dict):
    """The variant an export's ``architectures`` names (model/variants/), refused when none does."""
    variant = variant_of_export(cfg)
    if variant is None:
        raise ExportError(f"architectures={cfg.get('architectures')}: no drafter variant serves it (known: "
                          f"{', '.join(VARIANTS.get(n).architecture for n in VARIANTS.names())})")
    return variant


def _rope_parameters(cfg: dict) -> dict:
    """The exported RoPE (rope_parameters, or tf-4 rope_theta + rope_scaling) as the drafter's rope parameters."""
    try:
        rope = drafter_rope_parameters(cfg)
    except ConfigError as e:
        raise ExportError(f"config.json RoPE: {e}") from e
    params = cfg.get("rope_parameters") or {}
    if isinstance(params, dict) and (params.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ExportError(f"partial_rotary_factor={params['partial_rotary_factor']}: DFlashDrafter rotates whole heads")
    return rope


def _attention_layout(cfg: dict) -> tuple[Optional[list], Optional[int]]:
    """(layer_types or None for all full, sliding_window) of an export, refusing what some loader would serve
    differently from this reading (each rule names the loader)."""
    n = int(cfg["num_hidden_layers"])
    dfc = cfg.get("dflash_config") or {}
    types = cfg.get("layer_types")
    if cfg.get("is_causal") or dfc.get("causal"):
        raise ExportError("is_causal / dflash_config.causal is true: DFlashDrafter's layers are non-causal")
    if types is None:
        if dfc.get("use_swa"):
            raise ExportError("dflash_config.use_swa without layer_types: give layer_types (vLLM makes every layer "
                              "sliding, transformers' Qwen3Config does not)")
        return None, None
    types = [str(t) for t in types]
    bad = sorted(set(types) - {"full_attention", "sliding_attention"})
    if bad or len(types) != n:
        raise ExportError(f"layer_types {types}: need {n} entries, each full_attention or sliding_attention")
    if "sliding_attention" not in types:
        if dfc.get("use_swa"):
            raise ExportError("dflash_config.use_swa=true with all-full layer_types: vLLM would make every layer "
                              "sliding (qwen3_dflash.py), the z-lab model none")
        return None, None
    window = cfg.get("sliding_window")
    if window is None or int(window) < 1:
        raise ExportError(f"sliding_attention layers with sliding_window={window}")
    if not cfg.get("use_sliding_window"):
        raise ExportError("sliding_attention layers with use_sliding_window false: transformers' Qwen3Config then "
                          "drops sliding_window and the z-lab model runs full attention")
    if "is_causal" not in cfg and "causal" not in dfc:
        raise ExportError("sliding_attention layers without is_causal: false: vLLM and the z-lab model make "
                          "sliding layers causal by default, DFlashDrafter's are not")
    swa = dfc.get("swa_window_size")
    if swa is not None and int(swa) != int(window):
        raise ExportError(f"dflash_config.swa_window_size={swa} != sliding_window={window} (vLLM prefers the "
                          "former, the z-lab model reads the latter)")
    if dfc.get("use_swa") and not all(t == "sliding_attention" for t in types):
        log.info("dflash_config.use_swa with mixed layer_types: vLLM follows layer_types")
    return types, int(window)


def load_export(path: str, device: Any = "cpu", dtype: Optional[torch.dtype] = torch.float32,
                backend: str = "sdpa", require_complete: Optional[bool] = None) -> tuple[DFlashDrafter, dict]:
    """(DFlashDrafter in eval mode, meta) from an export directory.

    ``require_complete``: refuse an export without every field of :func:`export_problems`; None: required for
    exports of this project (those with ``dflash_dist_meta.json``), not for a z-lab release.

    ``dtype=None`` keeps the file's dtype. ``meta``: ``layer_ids``, ``mask_token_id``, ``block_size``,
    ``num_target_layers``, ``config`` (config.json), ``drafter_config`` (dict), ``tokenizer`` (``path`` when it
    holds tokenizer files, else None), ``eos_token_id``, and, for our own exports, ``target`` (the training
    job's target section), ``data`` and ``source_checkpoint``.
    """
    from safetensors.torch import load_file
    cfg_path = os.path.join(path, "config.json")
    st_path = os.path.join(path, "model.safetensors")
    if not (os.path.exists(cfg_path) and os.path.exists(st_path)):
        raise ExportError(f"{path}: not an export directory (needs config.json and model.safetensors)")
    cfg, header = checked_export(path)
    check_variant_fields(cfg, "config.json is not a {title} export both engines load alike: ")
    try:
        variant = _export_variant(cfg)
    except ExportError as e:
        raise ExportError(f"{path}: {e}") from None
    if require_complete is None:
        require_complete = os.path.exists(os.path.join(path, META_NAME))
    problems = export_problems(cfg, path) if require_complete else []
    if problems:
        raise ExportError(f"{path}: incomplete export (re-export it with this version of dflash-export): "
                          + "; ".join(problems))
    try:
        dcfg = drafter_config_from_export(cfg)
    except ExportError:
        raise
    except (ValueError, TypeError, KeyError) as e:  # well-typed values that do not fit (e.g. heads that do not divide)
        raise CheckpointInputError(f"export {path} is unusable: {cfg_path}: {e}") from None
    validate_variant_tensors({k: _Shape(shape) for k, (_, shape) in header.items()}, cfg)  # before reading any
    tensors = load_file(st_path)
    bad = [k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise CheckpointInputError(f"export {path} is unusable: {st_path}: tensors {bad[:6]} hold NaN or inf")
    if dtype is None:
        dtype = next(iter(tensors.values())).dtype
    model = variant.build(dcfg, backend)
    model.load_state_dict(variant.import_names(tensors), strict=True)
    model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    dfc = cfg["dflash_config"]
    meta: dict[str, Any] = {
        "layer_ids": [int(i) for i in dfc["target_layer_ids"]],
        "mask_token_id": int(dfc["mask_token_id"]),
        "mask_token": dfc.get("mask_token"),
        "block_size": dcfg.block_size,
        "num_target_layers": cfg.get("num_target_layers"),
        "eos_token_id": cfg.get("eos_token_id"),
        "config": cfg,
        "drafter_config": dict(dcfg.__dict__),
        "tokenizer": path if any(os.path.exists(os.path.join(path, n))
                                 for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")) else None,
    }
    side_path = os.path.join(path, META_NAME)
    if os.path.exists(side_path):
        with open(side_path) as f:
            side = json.load(f)  # checked by checked_export
        for k in ("target", "data", "source_checkpoint", "step", "tokenizer_source", "chat_template_kwargs"):
            meta[k] = side.get(k)
    return model, meta
