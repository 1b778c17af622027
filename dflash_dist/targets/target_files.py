"""A target's files and config checked where they enter, before transformers reads them: a local target directory
holds its weights as safetensors (a pickled ``pytorch_model.bin`` is never loaded: unpickling runs what the file
says), its ``config.json`` is a bounded JSON object naming a ``model_type`` transformers builds as a causal LM, and
its RoPE values are ones transformers' RoPE functions can compute (no zero or negative factor, no zero
``original_max_position_embeddings``, no infinity), its ``quantization_config`` one the FP8 loader reads
(``targets/quant/load.checkpoint_format``). Every refusal is one ConfigError line naming the location, the
field and what is allowed; transformers' own errors on a config (a division by zero in its validation, an unknown
key) become such a line too."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Optional

from dflash_dist.config import ConfigError

PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
# errors transformers raises on a config it cannot use (its rope validation divides by
# original_max_position_embeddings, a config class rejects a field of the wrong type ...)
CONFIG_ERRORS: tuple = (ValueError, TypeError, KeyError, ArithmeticError, AttributeError, IndexError)
try:  # transformers 5's config classes are huggingface_hub strict dataclasses: a field of the wrong type
    from huggingface_hub.errors import StrictDataclassError
    CONFIG_ERRORS += (StrictDataclassError,)
except ImportError:
    pass


def supported_families() -> str:
    """The registered target families and their model types, for a refusal."""
    from dflash_dist.targets.families import REGISTRY
    named = [f"{f.name} ({', '.join(f.model_types)})" for f in REGISTRY if f.model_types]
    return "; ".join(named)


def check_model_type(cfg: dict, where: str) -> None:
    """``model_type`` of a config dict: a string transformers knows and builds as a causal LM."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    mt = cfg.get("model_type")
    if isinstance(mt, str) and mt in CONFIG_MAPPING and mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return
    why = ("is missing" if mt is None else "is not a model type transformers knows" if not isinstance(mt, str)
           or mt not in CONFIG_MAPPING else "is not a causal language model transformers can build")
    raise ConfigError(f"{where}: model_type={mt!r} {why}; the supported target families are {supported_families()} "
                      "(another decoder transformers builds as AutoModelForCausalLM is checked by the default rules)")


def _positive(v: Any, allow_zero: bool = False) -> bool:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return ok and (v >= 0 if allow_zero else v > 0)


def rope_problem(params: dict) -> Optional[str]:
    """Why one RoPE parameter dict (``rope_parameters`` or transformers 4's ``rope_scaling``) cannot be computed,
    or None: factors, theta and betas finite and positive, ``original_max_position_embeddings`` a positive whole
    number, llama3's two frequency factors different (transformers divides by their difference)."""
    for key in ("factor", "rope_theta", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast",
                "beta_slow"):
        if params.get(key) is not None and not _positive(params[key]):
            return f"{key}={params[key]!r}: a finite number > 0"
    for key in ("mscale", "mscale_all_dim"):
        if params.get(key) is not None and not _positive(params[key], allow_zero=True):
            return f"{key}={params[key]!r}: a finite number >= 0"
    omax = params.get("original_max_position_embeddings")
    if omax is not None and (not isinstance(omax, int) or isinstance(omax, bool) or omax <= 0):
        return f"original_max_position_embeddings={omax!r}: a whole number > 0"
    lo, hi = params.get("low_freq_factor"), params.get("high_freq_factor")
    if lo is not None and hi is not None and lo == hi:
        return f"low_freq_factor={lo!r} equals high_freq_factor: llama3 RoPE divides by their difference"
    for key in ("short_factor", "long_factor"):
        v = params.get(key)
        if v is not None and (not isinstance(v, list) or not all(_positive(x) for x in v)):
            return f"{key}: a list of finite numbers > 0"
    return None


def check_rope(cfg: Any, where: str) -> None:
    """The RoPE values of a target config (dict or object; a multimodal wrapper's text config too; per layer type
    each), refused with the field when transformers' RoPE functions could not compute them."""
    from dflash_dist.targets.families import cfg_get, text_config
    for c in {id(x): x for x in (cfg, text_config(cfg))}.values():
        for name in ("rope_parameters", "rope_scaling"):
            params = cfg_get(c, name, None)
            if params is None:
                continue
            if not isinstance(params, dict):
                raise ConfigError(f"{where}: {name}={str(params)[:80]!r}: an object of RoPE parameters")
            kinds = params.items() if params and all(isinstance(v, dict) or v is None for v in params.values()) \
                else [("", params)]
            for kind, p in kinds:
                why = rope_problem(p or {})
                if why:
                    raise ConfigError(f"{where}: {name}{'.' + kind if kind else ''}.{why}")


def read_config_json(path: str, where: str) -> dict:
    """A local target directory's config.json: a regular file of bounded size (a hub cache snapshot links it
    into the cache's blobs), a JSON object."""
    from dflash_dist.checkpoint.safe_io import MAX_JSON_BYTES, CheckpointError, regular_file
    file = os.path.join(path, "config.json")
    try:
        regular_file(path, file, MAX_JSON_BYTES, contained=False)
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except CheckpointError as e:
        raise ConfigError(f"{where}: {e}") from None
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"{where}: {file}: unreadable JSON ({str(e)[:200]})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: {file}: a JSON {type(cfg).__name__}, expected an object")
    return cfg


def check_weights(path: str, where: str) -> None:
    """A local target directory holds safetensors weights; pickled ones alone are refused, never unpickled."""
    names = os.listdir(path)
    if any(n in names for n in SAFETENSORS):
        return
    pickled = sorted(n for n in names if n.endswith(PICKLED_SUFFIXES))
    if pickled:
        raise ConfigError(f"{where}: {os.path.join(path, pickled[0])} is a pickle and the directory has no "
                          "model.safetensors: a pickle can run code when it is loaded, so it is never read; convert "
                          "the weights to safetensors (save_pretrained(..., safe_serialization=True)) where you trust "
                          "the file")
    raise ConfigError(f"{where}: no model.safetensors or model.safetensors.index.json in {path}")


def check_target_dir(path: str, where: str = "target.name_or_path") -> None:
    """A local target directory before transformers reads it: its config.json (model type, RoPE values) and its
    weights' format. A hub id is left to transformers (``use_safetensors=True`` there, and the loaded config is
    checked by :func:`check_rope`)."""
    if not os.path.isdir(path):
        return
    where = f"{where}={path}"
    cfg = read_config_json(path, where)
    check_model_type(cfg, f"{where}: config.json")
    check_rope(cfg, f"{where}: config.json")
    from dflash_dist.targets.quant.load import checkpoint_format
    checkpoint_format(cfg, f"{where}: config.json")  # a quantization_config of the wrong shape, before transformers
    check_weights(path, where)


def config_error(where: str, e: BaseException) -> ConfigError:
    """transformers' error on a config as one line naming where it came from."""
    first = " ".join(line.strip() for line in str(e).splitlines() if line.strip())[:300] or type(e).__name__
    return ConfigError(f"{where}: the config does not load in transformers: {type(e).__name__}: {first}")
