"""A checkpoint directory is data from elsewhere: check it before anything is opened, built or allocated.

The value checks here also serve an export directory's (export/validate.py). Every check raises :class:`~dflash_dist.checkpoint.safe_io.CheckpointError` with one line that names the file and the
field to look at. What is checked:

* files: ``meta.json``'s ``files`` names plain files of this directory (no ``/``, no ``..``); every file read is
  a regular file of bounded size, no symlink out of the directory (``safe_io.regular_file``);
* ``meta.json``: a schema (every known key with its type and range, unknown keys refused), the drafter's sizes
  against sane bounds, each other and this machine's memory, the job's sections against the config dataclasses;
  where a target is built from them (dflash-eval), its attention / experts implementations must be transformers' own
  (:func:`local_attention`, :func:`local_experts`) unless the command line names others;
* ``model.safetensors``: the header (its length, JSON, dtypes, shapes, offsets) against the file's size, so a
  header of 2^60 bytes or a tensor past the end is refused before safetensors reads it;
* ``optimizer.pt``: the structure of an optimizer ``state_dict`` (loaded memory-mapped, tensors not read).

Hub locations (tokenizer, target) and Hub attention kernels are honoured only when the user names them on the
command line; locations read from a file are loaded from a local directory or their snapshot in the local
Hugging Face cache (:func:`local_dir`, ``local_files_only=True``), never the network.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import typing
from typing import Any, Optional

from dflash_dist.checkpoint.safe_io import (
    MAX_WEIGHTS_BYTES,
    CheckpointError,
    check_model_size,
    fail,
    inside,
    is_int,
    read_json,
    regular_file,
)
from dflash_dist.checkpoint.tensor_types import float_header

# sane upper bounds of what a drafter (and the target it reads) can be; far above every released model
BOUNDS = {
    "vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 19, "num_layers": 512,
    "num_hidden_layers": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 4096,
    "num_feature_layers": 256, "block_size": 4096, "max_position_embeddings": 1 << 24, "sliding_window": 1 << 24,
    "num_experts": 1 << 14, "moe_intermediate_size": 1 << 19,
}


def bounds() -> dict[str, int]:
    """:data:`BOUNDS` and every registered drafter variant's ``size_bounds`` (its ``variant_settings`` sizes)."""
    from dflash_dist.model.variants import registered_variants
    out = dict(BOUNDS)
    for v in registered_variants():
        out.update(v.size_bounds)
    return out


MAX_LAYER_ID = 4096
CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt")
# attention / experts implementations transformers runs from its own code or an installed package (no Hub kernel
# download); "auto" resolves to one of them (targets/hf.resolve_attn_implementation)
LOCAL_ATTENTION = ("auto", "eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "paged|eager")
LOCAL_EXPERTS = ("eager", "batched_mm", "grouped_mm")


# ---------------------------------------------------------------------------------------------- files

def check_files(directory: str, meta: dict) -> None:
    """Each file ``meta.json`` lists is a plain file here with the recorded size."""
    meta_path = os.path.join(directory, "meta.json")
    files = meta.get("files", {})
    if not isinstance(files, dict):
        raise fail(meta_path, "files", f"a {type(files).__name__}, expected {{name: size}}")
    for name, nbytes in files.items():
        path = inside(directory, name)
        if name not in CHECKPOINT_FILES:
            raise fail(meta_path, "files", f"{name!r}: a checkpoint holds only {', '.join(CHECKPOINT_FILES)}")
        if not is_int(nbytes) or nbytes < 0:
            raise fail(meta_path, f"files.{name}", f"{nbytes!r} is not a byte count")
        have = regular_file(directory, path, MAX_WEIGHTS_BYTES)
        if have != nbytes:
            raise fail(path, "file", f"has {have} bytes, expected {nbytes} (truncated?)")
    if "model.safetensors" not in files:
        raise fail(meta_path, "files", "lists no model.safetensors")


# ---------------------------------------------------------------------------------------------- values

def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def count(file: str, field: str, v: Any, lo: int = 0, hi: int = 1 << 62) -> int:
    """An integer in [lo, hi]."""
    if not is_int(v):
        raise fail(file, field, f"{v!r} is a {type(v).__name__}, expected an integer")
    if not lo <= v <= hi:
        raise fail(file, field, f"{v} is out of range [{lo}, {hi}]")
    return v


def size(file: str, field: str, v: Any) -> int:
    """A model size (the last part of ``field`` names its bound)."""
    return count(file, field, v, 1, bounds()[field.rsplit(".", 1)[-1]])


def check_sizes(file: str, prefix: str, cfg: dict) -> None:
    """Every bounded size key of an HF-style config dict (and of its ``text_config``) is in range."""
    known = bounds()
    for k, v in cfg.items():
        if k in known and v is not None:
            size(file, f"{prefix}{k}", v)
    if isinstance(cfg.get("text_config"), dict):
        check_sizes(file, f"{prefix}text_config.", cfg["text_config"])


def check_type(file: str, field: str, value: Any, tp: Any) -> None:
    """``value`` fits the type annotation ``tp`` (int, float, str, bool, Optional, list, dict, Literal,
    tuple, nested config dataclasses)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return
    if origin is typing.Union:
        if value is None and type(None) in args:
            return
        for a in args:
            if a is not type(None):
                try:
                    return check_type(file, field, value, a)
                except CheckpointError:
                    continue
        raise fail(file, field, f"{value!r} does not fit {tp}")
    if origin is typing.Literal:
        if value not in args:
            raise fail(file, field, f"{value!r}: expected one of {list(args)}")
        return
    if dataclasses.is_dataclass(tp):
        check_section(file, field, value, tp)
        return
    ok = {int: is_int(value), float: _is_num(value), bool: isinstance(value, bool), str: isinstance(value, str)}
    if tp in ok:
        if not ok[tp]:
            raise fail(file, field, f"{value!r} is a {type(value).__name__}, expected {tp.__name__}")
        return
    base = origin or tp
    if base in (list, tuple) and not isinstance(value, (list, tuple)):
        raise fail(file, field, f"a {type(value).__name__}, expected a list")
    if base is dict and not isinstance(value, dict):
        raise fail(file, field, f"a {type(value).__name__}, expected an object")
    if base in (list, tuple) and args and args[-1] is not Ellipsis and len(args) == 1:
        for i, item in enumerate(value):
            check_type(file, f"{field}[{i}]", item, args[0])


def check_section(file: str, field: str, value: Any, cls: type) -> None:
    """A config section (dict) of dataclass ``cls``: known keys only, each of its field's type."""
    if not isinstance(value, dict):
        raise fail(file, field, f"a {type(value).__name__}, expected an object")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k, v in value.items():
        if k not in names:
            raise fail(file, f"{field}.{k}", f"unknown key (known: {', '.join(sorted(names))})")
        check_type(file, f"{field}.{k}", v, hints[k])


def local_attention(file: str, field: str, impl: Any) -> None:
    """An attention implementation read from a file must be one transformers runs from its own code."""
    if impl is None or impl in LOCAL_ATTENTION:
        return
    if isinstance(impl, str) and impl.startswith("flash_attention_") and _flash_attn_installed(impl):
        return
    raise fail(file, field, f"{impl!r}: a file may name only {', '.join(LOCAL_ATTENTION)} (or an installed "
               "flash_attention_N); anything else can load a kernel from the Hugging Face Hub: pass it on the "
               "command line if you mean it")


def local_experts(file: str, field: str, impl: Any) -> None:
    if impl is None or impl in LOCAL_EXPERTS:
        return
    raise fail(file, field, f"{impl!r}: a file may name only {', '.join(LOCAL_EXPERTS)}; pass another "
               "implementation on the command line if you mean it")


def _flash_attn_installed(impl: str) -> bool:
    """The original flash-attn package of ``flash_attention_N`` is installed (else transformers falls back to a
    Hub kernel)."""
    try:
        from transformers.modeling_flash_attention_utils import FLASH_ATTENTION_COMPATIBILITY_MATRIX as m
        return bool(m[int(impl.rsplit("_", 1)[1])]["general_availability_check"]())
    except Exception:
        return False


def local_location(file: str, field: str, value: Any) -> Optional[str]:
    """A tokenizer / target location read from a file: a string (loaded with ``local_files_only=True``)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or "\0" in value:
        raise fail(file, field, f"{value!r} is not a path")
    return value


# ---------------------------------------------------------------------------------------------- meta.json

def _nonneg(file, field, v):
    return count(file, field, v)


def _opt_str(file, field, v):
    if v is not None and not isinstance(v, str):
        raise fail(file, field, f"a {type(v).__name__}, expected a string")


def _obj(file, field, v):
    if not isinstance(v, dict):
        raise fail(file, field, f"a {type(v).__name__}, expected an object")


def _bool(file, field, v):
    if not isinstance(v, bool):
        raise fail(file, field, f"{v!r} is not true or false")


def _layer_ids(file, field, v):
    if not isinstance(v, list) or not 1 <= len(v) <= BOUNDS["num_feature_layers"]:
        raise fail(file, field, f"{str(v)[:80]} is not a list of 1..{BOUNDS['num_feature_layers']} layer ids")
    for i, x in enumerate(v):
        count(file, f"{field}[{i}]", x, 0, MAX_LAYER_ID)


def _counts(file, field, v):
    _obj(file, field, v)
    for k, x in v.items():
        _nonneg(file, f"{field}.{k}", x)


def code_name(file: str, field: str, name: Any, registry) -> None:
    """A variant / objective named in a file: a registered one, or a ``module:Class`` (a subclass of the kind's
    base) whose module the calling program imported itself (model/registry ``get_named_in_file``). A file never
    makes this process import a module or call what it names."""
    from dflash_dist.config import ConfigError
    if not isinstance(name, str) or not name:
        raise fail(file, field, f"{name!r} is not a name")
    try:
        registry.get_named_in_file(name)
    except ConfigError as e:
        raise fail(file, field, str(e)) from None


def _drafter_settings(file, field, v):
    """The resolved drafter's settings (model/spec.DrafterSpec.to_meta without the model config)."""
    from dflash_dist.model.objectives import OBJECTIVES
    from dflash_dist.model.variants import VARIANTS
    if v is None:  # written before variants: DFlash, decayed CE
        return
    _obj(file, field, v)
    code_name(file, f"{field}.variant", v.get("variant", "dflash"), VARIANTS)
    loss = v.get("loss", {})
    _obj(file, f"{field}.loss", loss)
    code_name(file, f"{field}.loss.objective", loss.get("objective", "decayed_ce"), OBJECTIVES)
    for key, choices in (("labels", ("data", "target")), ("kind", ("ce", "kl"))):
        if loss.get(key, choices[0]) not in choices:
            raise fail(file, f"{field}.loss.{key}", f"{loss[key]!r}: one of {', '.join(choices)}")
    top_k = loss.get("kl_top_k", 20)
    if not (isinstance(top_k, int) and not isinstance(top_k, bool) and 1 <= top_k <= 1024):
        raise fail(file, f"{field}.loss.kl_top_k", f"{top_k!r}: an integer in 1..1024")
    if loss.get("weighting", "decay") not in ("decay", "dpace"):
        raise fail(file, f"{field}.loss.weighting", f"{str(loss.get('weighting'))[:40]!r} is not decay or dpace")
    alpha = loss.get("dpace_alpha", 0.5)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
        raise fail(file, f"{field}.loss.dpace_alpha", f"{str(alpha)[:40]} is not a number in (0, 1]")


def _identity(file, field, v):
    """{part: {hash, label, fields (optional: config key -> value)}} (checkpoint/identity.py)."""
    _obj(file, field, v)
    for part, rec in v.items():
        if not (isinstance(rec, dict) and isinstance(rec.get("hash"), str) and len(rec["hash"]) <= 128
                and isinstance(rec.get("label", ""), str)):
            raise fail(file, f"{field}.{part}", "not an object with a hash and a label")
        if "fields" in rec:
            _obj(file, f"{field}.{part}.fields", rec["fields"])


# meta.json's keys (what the trainer and save_checkpoint write) and the check of each
META_SCHEMA = {
    "step": _nonneg, "cursor": _nonneg, "total_messages": _nonneg, "num_targets": _nonneg,
    "tensor_parallel": _nonneg, "num_drafters": _nonneg, "files": _obj, "reason": _opt_str, "final": _bool,
    "layer_ids": _layer_ids, "mask_token_id": _nonneg,
    "block_size": size, "drafter_config": _obj, "drafter": _drafter_settings, "target_config": _obj,
    "tokenizer": local_location, "job_config": _obj, "counts": _counts, "chat_template_kwargs": _obj,
    "identity": _identity, "run_totals": _counts,
}


def check_meta(directory: str, meta: dict) -> None:
    """meta.json against :data:`META_SCHEMA` and the drafter / job sections against each other."""
    file = os.path.join(directory, "meta.json")
    for k, v in meta.items():
        if k not in META_SCHEMA:
            raise fail(file, k, f"unknown key (known: {', '.join(sorted(META_SCHEMA))})")
        META_SCHEMA[k](file, k, v)
    if "step" not in meta:
        raise fail(file, "step", "missing")
    if "drafter_config" in meta:
        dc = check_drafter_config(file, "drafter_config", meta["drafter_config"])
        if "block_size" in meta and meta["block_size"] != dc["block_size"]:
            raise fail(file, "block_size", f"{meta['block_size']} != drafter_config.block_size {dc['block_size']}")
        if "layer_ids" in meta and len(meta["layer_ids"]) != dc["num_feature_layers"]:
            raise fail(file, "layer_ids", f"{len(meta['layer_ids'])} ids for drafter_config.num_feature_layers="
                       f"{dc['num_feature_layers']}")
        if "mask_token_id" in meta and meta["mask_token_id"] >= dc["vocab_size"]:
            raise fail(file, "mask_token_id", f"{meta['mask_token_id']} is outside the vocabulary "
                       f"(drafter_config.vocab_size={dc['vocab_size']})")
    if "target_config" in meta:
        check_sizes(file, "target_config.", meta["target_config"])
    if "job_config" in meta:
        check_job_config(file, "job_config", meta["job_config"])
    _check_same_target(file, meta)


def _check_same_target(file: str, meta: dict) -> None:
    """The drafter's hidden and vocabulary sizes (its hidden size is proven by the weights) are the recorded
    target's, and a random-init target's config says the same: no size reaches a model build unchecked."""
    dc = meta.get("drafter_config") or {}
    tc = meta.get("target_config") or {}
    tc = tc["text_config"] if isinstance(tc.get("text_config"), dict) else tc
    hf = ((meta.get("job_config") or {}).get("target") or {}).get("hf_config") or {}
    hf = hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf
    for k in ("hidden_size", "vocab_size"):
        for name, other in (("target_config", tc), ("job_config.target.hf_config", hf)):
            if k in dc and other.get(k) is not None and other[k] != dc[k]:
                raise fail(file, f"{name}.{k}", f"{other[k]} != drafter_config.{k} {dc[k]}")


_DRAFTER_SIZES = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                  "num_layers", "num_feature_layers", "block_size", "vocab_size", "max_position_embeddings")


def check_drafter_config(file: str, field: str, dc: Any) -> dict:
    """A DrafterModelConfig as a dict: known keys, types, every size in its bound, heads that divide."""
    from dflash_dist.model.drafter import DrafterModelConfig
    check_section(file, field, dc, DrafterModelConfig)
    required = [f.name for f in dataclasses.fields(DrafterModelConfig)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for k in required:
        if k not in dc:
            raise fail(file, f"{field}.{k}", "missing")
    for k in _DRAFTER_SIZES:
        size(file, f"{field}.{k}", dc[k])
    check_model_size(file, field, dc, "num_layers")   # built by every reader
    if dc.get("sliding_window") is not None:
        size(file, f"{field}.sliding_window", dc["sliding_window"])
    if dc.get("variant_settings") is not None:          # a variant's own section: its sizes bounded
        _obj(file, f"{field}.variant_settings", dc["variant_settings"])
        known = bounds()
        for k, v in dc["variant_settings"].items():
            if k in known:
                size(file, f"{field}.variant_settings.{k}", v)
    if dc["num_attention_heads"] % dc["num_key_value_heads"]:
        raise fail(file, f"{field}.num_key_value_heads", f"{dc['num_key_value_heads']} does not divide "
                   f"num_attention_heads={dc['num_attention_heads']}")
    if dc["head_dim"] % 2:
        raise fail(file, f"{field}.head_dim", f"{dc['head_dim']} must be even (RoPE)")
    if dc["num_attention_heads"] * dc["head_dim"] > BOUNDS["hidden_size"] * 4:
        raise fail(file, f"{field}.num_attention_heads", "num_attention_heads * head_dim is out of range")
    if not 0 < dc["rms_norm_eps"] < 1 or not 0 < dc["rope_theta"] < 1e12:
        raise fail(file, f"{field}.rms_norm_eps / rope_theta", "out of range")
    return dc


# settings that checkpoints of earlier versions record and that no longer exist; none changed a trained weight,
# so such a checkpoint still loads (they are left out of what is checked)
RETIRED_KEYS = (("drafter", "tuning", "compute_weights"),)


def without_retired(job: dict) -> dict:
    """A copy of a recorded job config without the :data:`RETIRED_KEYS`."""
    job = copy.deepcopy(job)
    for path in RETIRED_KEYS:
        d = job
        for k in path[:-1]:
            d = d.get(k) if isinstance(d, dict) else None
        if isinstance(d, dict):
            d.pop(path[-1], None)
    return job


def check_job_config(file: str, field: str, job: Any) -> None:
    """The training job's config sections: known groups and keys, each value of its field's type, the target's
    random-init sizes in bounds. (Its attention / experts implementations: :func:`local_attention` where a
    target is built from them.)"""
    from dflash_dist.config import GROUPS
    _obj(file, field, job)
    job = without_retired(job)
    for name, value in job.items():
        if name not in GROUPS:
            raise fail(file, f"{field}.{name}", f"unknown config group (known: {', '.join(sorted(GROUPS))})")
        check_section(file, f"{field}.{name}", value, GROUPS[name])
    t = job.get("target") or {}
    for k in ("name_or_path", "tokenizer"):
        local_location(file, f"{field}.target.{k}", t.get(k))
    check_sizes(file, f"{field}.target.hf_config.", t.get("hf_config") or {})
    check_model_size(file, f"{field}.target.hf_config", t.get("hf_config") or {})   # random init builds it
    try:  # each dataclass's own checks (choices, ranges) on what is now well-typed
        from dflash_dist.config import JobConfig
        JobConfig.from_dict({k: v for k, v in job.items()})
    except (ValueError, TypeError) as e:
        raise fail(file, field, str(e).splitlines()[0][:300]) from None


WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.")


def bare_name(name: str) -> str:
    """A tensor name without the wrapper prefixes DDP / torch.compile / HF add."""
    changed = True
    while changed:
        changed = False
        for p in WRAPPER_PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name


def check_weights(file: str, header: dict, drafter_config: dict, variant: str = "dflash") -> None:
    """The tensors of ``model.safetensors`` (wrapper prefixes aside) have exactly the names and shapes of the
    drafter ``drafter_config`` describes, of the recorded ``variant`` (built on the meta device: nothing
    allocated)."""
    import torch

    from dflash_dist.model.drafter import DrafterModelConfig
    from dflash_dist.model.variants import variant_class
    try:
        with torch.device("meta"):
            want = {k: tuple(v.shape) for k, v in variant_class(variant)().build(
                DrafterModelConfig(**drafter_config), "sdpa").state_dict().items()}
    except (ValueError, TypeError, KeyError) as e:
        raise fail(os.path.join(os.path.dirname(file), "meta.json"), "drafter_config", str(e)[:300]) from None
    have = {bare_name(k): shape for k, (_, shape) in header.items()}
    if len(have) != len(header):
        raise fail(file, "tensor names", "two tensors have the same name without their wrapper prefixes")
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    wrong = [f"{k}: {have[k]} != {want[k]}" for k in sorted(set(want) & set(have)) if want[k] != have[k]]
    parts = [f"missing {missing[:6]}"] if missing else []
    parts += [f"unexpected {extra[:6]}"] if extra else []
    parts += ["wrong shapes " + ", ".join(wrong[:6])] if wrong else []
    if parts:
        raise fail(file, "tensors", "do not match meta.json's drafter_config: " + "; ".join(parts))


# ---------------------------------------------------------------------------------------------- optimizer.pt

def check_optimizer_state(file: str, state: Any, weights: Optional[dict] = None) -> None:
    """An optimizer ``state_dict``: {state: {param index: {name: tensor or number}}, param_groups: [{params:
    [index, ...], ...}]}; with ``weights`` ({name: (dtype, shape)}), no more parameters than tensors and every
    state tensor of a weight's shape."""
    import torch
    if not isinstance(state, dict) or set(state) != {"state", "param_groups"}:
        keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise fail(file, "state_dict", f"{keys}: expected exactly state and param_groups")
    groups = state["param_groups"]
    if not isinstance(groups, list):
        raise fail(file, "param_groups", "not a list")
    ids: list = []
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or not isinstance(g.get("params"), list):
            raise fail(file, f"param_groups[{i}].params", "missing or not a list")
        for p in g["params"]:
            count(file, f"param_groups[{i}].params", p)
        ids += g["params"]
    if len(set(ids)) != len(ids):
        raise fail(file, "param_groups", "a parameter index appears twice")
    if not isinstance(state["state"], dict):
        raise fail(file, "state", "not an object")
    shapes = {shape for _, shape in (weights or {}).values()}
    if weights is not None and len(ids) > len(weights):
        raise fail(file, "param_groups", f"{len(ids)} parameters for the {len(weights)} tensors of the weights")
    for k, per in state["state"].items():
        if k not in ids or not isinstance(per, dict):
            raise fail(file, f"state[{k!r}]", "not a parameter of param_groups")
        for name, v in per.items():
            if isinstance(v, torch.Tensor):
                if weights is not None and v.dim() > 0 and tuple(v.shape) not in shapes:
                    raise fail(file, f"state[{k}].{name}", f"shape {tuple(v.shape)} of no weight tensor")
            elif not (_is_num(v) or isinstance(v, bool)):
                raise fail(file, f"state[{k}].{name}", f"a {type(v).__name__}, expected a tensor or number")


# ---------------------------------------------------------------------------------------------- directories

def check_checkpoint(path: str) -> tuple[dict, dict]:
    """(meta, {name: (dtype, shape)} of model.safetensors) of a checkpoint directory whose every file but
    optimizer.pt checks out (that one: :func:`check_optimizer_state` once loaded)."""
    meta_path = os.path.join(path, "meta.json")
    if not os.path.lexists(meta_path):
        raise CheckpointError("no meta.json (partial write?)")
    meta = read_json(path, "meta.json")
    check_files(path, meta)
    check_meta(path, meta)
    st = os.path.join(path, "model.safetensors")
    header = float_header(st)
    if "drafter_config" in meta:
        from dflash_dist.checkpoint.meta import meta_variant
        check_weights(st, header, meta["drafter_config"], meta_variant(meta))
    return meta, header
