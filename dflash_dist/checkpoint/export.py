"""Export a training checkpoint as a z-lab ``DFlashDraftModel`` directory (what vLLM and SGLang load).

``dflash-export <checkpoint_dir> <out_dir> [--dtype bfloat16] [--overwrite] [--no-tokenizer]``

The directory holds:

* ``config.json``: a Qwen3 config (``model_type: qwen3``, ``architectures: ["DFlashDraftModel"]``) with the
  drafter's sizes, ``num_hidden_layers`` = drafter layers, ``num_target_layers`` = target layers, top-level
  ``block_size`` and ``dflash_config: {mask_token_id, target_layer_ids, block_size}``. Layer id i is the output
  of target decoder layer i (HF ``hidden_states[i+1]``), the z-lab convention.
* ``model.safetensors``: ``layers.*``, ``fc.weight`` [H, n*H], ``hidden_norm.weight``, ``norm.weight``; no
  ``model.`` prefix, no embedding, no lm_head (both are the target's), bf16 by default.
* the target tokenizer (``AutoTokenizer.save_pretrained``), so the directory is self-contained.
* ``dflash_dist_meta.json``: provenance for this project (source checkpoint, step, the job's target section)
  so ``dflash-eval --export`` can rebuild the same target. Serving engines ignore it.

``load_export(dir)`` reads such a directory (ours or a z-lab release with default RoPE and full attention)
back into a :class:`~dflash_dist.model.drafter.DFlashDrafter`.

The directory is written into a temporary sibling and renamed, so an interrupted export leaves nothing that
looks complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, Optional

import torch

from dflash_dist.checkpoint.store import checkpoint_problem
from dflash_dist.config import ConfigError
from dflash_dist.model.drafter import DFlashDrafter, DrafterModelConfig
from dflash_dist.model.rope import drafter_rope_parameters

log = logging.getLogger(__name__)


__all__ = ["export_checkpoint", "build_export_config", "expected_tensor_shapes", "validate_export_tensors",
           "load_export", "ExportError", "META_NAME"]


META_NAME = "dflash_dist_meta.json"


META_FORMAT = "dflash_dist.export/1"


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


_STRIP_PREFIXES = ("module.", "_orig_mod.", "model.")


class ExportError(ValueError):
    """The checkpoint or export directory cannot be used; the message says why."""


def _text_config_dict(target_config: dict) -> dict:
    """Multimodal wrappers (Qwen3.5) keep the language model's fields in ``text_config``."""
    tc = target_config.get("text_config")
    if isinstance(tc, dict) and "hidden_size" in tc:
        merged = dict(tc)
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):  # ids may live on the wrapper only
            if merged.get(k) is None and target_config.get(k) is not None:
                merged[k] = target_config[k]
        return merged
    return target_config


def build_export_config(drafter_config: DrafterModelConfig, target_config: dict, layer_ids: list,
                        mask_token_id: int, block_size: int, dtype: str = "bfloat16") -> dict:
    """The z-lab ``config.json`` of a drafter trained on a target whose HF config dict is ``target_config``."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype={dtype!r}: use one of {sorted(DTYPES)}")
    dc = drafter_config
    tc = _text_config_dict(dict(target_config))
    num_target_layers = tc.get("num_hidden_layers")
    if num_target_layers is None:
        raise ExportError("the checkpoint's target_config has no num_hidden_layers")
    layer_ids = [int(i) for i in layer_ids]
    if len(layer_ids) != dc.num_feature_layers:
        raise ExportError(f"{len(layer_ids)} layer_ids {layer_ids} but the drafter takes "
                          f"{dc.num_feature_layers} feature layers (fc input {dc.num_feature_layers}*H)")
    bad = [i for i in layer_ids if not 0 <= i < int(num_target_layers)]
    if bad:
        raise ExportError(f"layer_ids {bad} out of range for a {num_target_layers}-layer target")
    if int(block_size) != dc.block_size:
        raise ExportError(f"meta block_size={block_size} but drafter_config.block_size={dc.block_size}")
    if dc.hidden_act != "silu":
        raise ExportError(f"hidden_act={dc.hidden_act!r}: the z-lab layout is silu only")

    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": dc.hidden_size,
        "num_attention_heads": dc.num_attention_heads,
        "num_key_value_heads": dc.num_key_value_heads,
        "head_dim": dc.head_dim,
        "intermediate_size": dc.intermediate_size,
        "rms_norm_eps": dc.rms_norm_eps,
        "max_position_embeddings": dc.max_position_embeddings,
        "vocab_size": dc.vocab_size,
        "hidden_act": "silu",
        "initializer_range": dc.initializer_range,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
    }
    # RoPE: the drafter's theta (default RoPE only, DrafterModelConfig refuses scaling), written under the
    # key(s) the target uses: rope_theta (transformers 4) and/or rope_parameters (transformers 5).
    has_params = isinstance(tc.get("rope_parameters"), dict)
    has_theta = tc.get("rope_theta") is not None
    if has_theta or not has_params:
        cfg["rope_theta"] = dc.rope_theta
    rope = dc.rope_params()  # the drafter's RoPE (model/rope.py): what the served model must compute
    if has_params or rope["rope_type"] != "default":
        cfg["rope_parameters"] = rope
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        cfg[k] = tc.get(k)
    cfg.update({
        "num_hidden_layers": dc.num_layers,
        "num_target_layers": int(num_target_layers),
        "block_size": int(block_size),
        "dflash_config": {"mask_token_id": int(mask_token_id), "target_layer_ids": layer_ids,
                          "block_size": int(block_size)},
        "layer_types": ["full_attention"] * dc.num_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": dc.num_layers,
        "use_cache": False,
        "is_causal": False,
        "torch_dtype": dtype,
        "dtype": dtype,
    })
    if not 0 <= int(mask_token_id) < dc.vocab_size:
        raise ExportError(f"mask_token_id={mask_token_id} is outside the vocabulary (size {dc.vocab_size})")
    return cfg


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


def drafter_config_from_export(cfg: dict) -> DrafterModelConfig:
    """DrafterModelConfig of an exported ``config.json`` (ours or z-lab's)."""
    dfc = cfg.get("dflash_config") or {}
    layer_ids = dfc.get("target_layer_ids")
    if not layer_ids:
        raise ExportError("config.json has no dflash_config.target_layer_ids")
    block_size = dfc.get("block_size", cfg.get("block_size"))
    if block_size is None:
        raise ExportError("config.json has no block_size (top level or dflash_config)")
    types = cfg.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types):
        raise ExportError(f"layer_types {sorted(set(types))}: only full_attention drafters are supported")
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
    )


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
    want = expected_tensor_shapes(cfg)
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
        if wrong:
            parts.append("wrong shapes " + ", ".join(f"{k}: {have[k]} != {want[k]}" for k in wrong[:6]))
        raise ExportError("drafter tensors do not match the exported config: " + "; ".join(parts))


def _strip_prefixes(weights: dict) -> dict:
    out = {}
    for k, v in weights.items():
        name = k
        changed = True
        while changed:
            changed = False
            for p in _STRIP_PREFIXES:
                if name.startswith(p):
                    name, changed = name[len(p):], True
        if name in out:
            raise ExportError(f"two checkpoint tensors map to {name!r} after removing wrapper prefixes")
        out[name] = v
    return out


def _read_checkpoint(checkpoint_dir: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file
    if not os.path.isdir(checkpoint_dir):
        raise ExportError(f"{checkpoint_dir}: not a directory")
    problem = checkpoint_problem(checkpoint_dir)
    if problem is not None:
        raise ExportError(f"checkpoint {checkpoint_dir} is unusable: {problem}")
    with open(os.path.join(checkpoint_dir, "meta.json")) as f:
        meta = json.load(f)
    for key in ("layer_ids", "mask_token_id", "block_size", "drafter_config", "target_config"):
        if key not in meta:
            raise ExportError(f"checkpoint {checkpoint_dir}: meta.json has no {key!r}")
    weights = load_file(os.path.join(checkpoint_dir, "model.safetensors"))
    return weights, meta


def export_checkpoint(checkpoint_dir: str, out_dir: str, dtype: str = "bfloat16", tokenizer: bool = True,
                      overwrite: bool = False, tokenizer_path: Optional[str] = None) -> str:
    """Write the z-lab layout of ``checkpoint_dir`` to ``out_dir``; returns ``out_dir``.

    ``tokenizer_path`` overrides the checkpoint meta's ``tokenizer``. Refuses a partial checkpoint
    (``checkpoint.checkpoint_problem``), a non-empty ``out_dir`` unless ``overwrite``, and tensors whose
    names/shapes do not match the config it writes.
    """
    from safetensors.torch import save_file
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: use one of {sorted(DTYPES)}")
    weights, meta = _read_checkpoint(checkpoint_dir)
    dcfg = DrafterModelConfig(**meta["drafter_config"])
    cfg = build_export_config(dcfg, meta["target_config"], meta["layer_ids"], meta["mask_token_id"],
                              meta["block_size"], dtype)
    tensors = _strip_prefixes(weights)
    validate_export_tensors(tensors, cfg)
    # the module must agree with the config too (the same check a consumer's strict load would do)
    with torch.device("meta"):
        ref = DFlashDrafter(drafter_config_from_export(cfg), "sdpa").state_dict()
    validate_export_tensors({k: v for k, v in ref.items()}, cfg)
    bad = [k for k, v in tensors.items() if not bool(torch.isfinite(v.float()).all())]
    if bad:
        raise ExportError(f"non-finite values in {bad[:6]}: refusing to export a diverged drafter")
    tensors = {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in sorted(tensors.items())}

    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ExportError(f"{out_dir} exists and is not a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ExportError(f"{out_dir} is not empty: pass --overwrite to replace it")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp_export_{os.path.basename(out_dir)}_{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        tok_src = tokenizer_path or meta.get("tokenizer")
        if tokenizer:
            if not tok_src:
                raise ExportError("the checkpoint meta names no tokenizer: pass --tokenizer PATH or --no-tokenizer")
            from transformers import AutoTokenizer
            try:
                tok = AutoTokenizer.from_pretrained(tok_src)
            except Exception as e:
                raise ExportError(f"cannot load the tokenizer {tok_src!r} ({type(e).__name__}: {e}); pass "
                                  "--tokenizer PATH or --no-tokenizer") from e
            tok.save_pretrained(tmp)
        job = meta.get("job_config") or {}
        side = {"format": META_FORMAT, "source_checkpoint": os.path.abspath(checkpoint_dir),
                "step": meta.get("step"), "final": meta.get("final"), "cursor": meta.get("cursor"),
                "layer_ids": list(meta["layer_ids"]), "mask_token_id": int(meta["mask_token_id"]),
                "block_size": int(meta["block_size"]), "drafter_config": meta["drafter_config"],
                "target": job.get("target"), "data": job.get("data"), "tokenizer_source": tok_src,
                "dtype": dtype}
        with open(os.path.join(tmp, META_NAME), "w") as f:
            json.dump(side, f, indent=1)
        # read back what a consumer reads: names/shapes of the file against the config in the file
        from safetensors import safe_open
        with safe_open(os.path.join(tmp, "model.safetensors"), "pt") as f:
            back = {k: f.get_slice(k) for k in f.keys()}
            validate_export_tensors({k: _Shape(s.get_shape()) for k, s in back.items()}, cfg)
        umask = os.umask(0)
        os.umask(umask)
        for name in os.listdir(tmp):  # safetensors writes 0600; an export is meant to be shared
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        os.chmod(tmp, 0o777 & ~umask)
        if os.path.isdir(out_dir):
            old = out_dir + f".old_{os.getpid()}"
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


class _Shape:
    def __init__(self, shape):
        self.shape = tuple(shape)


def load_export(path: str, device: Any = "cpu", dtype: Optional[torch.dtype] = torch.float32,
                backend: str = "sdpa") -> tuple[DFlashDrafter, dict]:
    """(DFlashDrafter in eval mode, meta) from an export directory.

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
    with open(cfg_path) as f:
        cfg = json.load(f)
    arch = cfg.get("architectures") or []
    if "DFlashDraftModel" not in arch:
        raise ExportError(f"{path}: architectures={arch}, expected DFlashDraftModel")
    dcfg = drafter_config_from_export(cfg)
    tensors = load_file(st_path)
    validate_export_tensors(tensors, cfg)
    if dtype is None:
        dtype = next(iter(tensors.values())).dtype
    model = DFlashDrafter(dcfg, backend)
    model.load_state_dict(tensors, strict=True)
    model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    dfc = cfg["dflash_config"]
    meta: dict[str, Any] = {
        "layer_ids": [int(i) for i in dfc["target_layer_ids"]],
        "mask_token_id": int(dfc["mask_token_id"]),
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
            side = json.load(f)
        for k in ("target", "data", "source_checkpoint", "step", "tokenizer_source"):
            meta[k] = side.get(k)
    return model, meta
