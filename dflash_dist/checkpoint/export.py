"""Export a training checkpoint as a z-lab ``DFlashDraftModel`` directory (what vLLM and SGLang load).

``dflash-export <checkpoint_dir> <out_dir> [--dtype bfloat16] [--overwrite] [--no-tokenizer]``

The directory holds:

* ``config.json``: a Qwen3 config (``model_type: qwen3``, ``architectures: ["DFlashDraftModel"]``) with the
  drafter's sizes, ``num_hidden_layers`` = drafter layers, ``num_target_layers`` = target layers, top-level
  ``block_size`` and ``dflash_config: {mask_token_id, mask_token, target_layer_ids, block_size}``. Layer id i is
  the output of target decoder layer i (HF ``hidden_states[i+1]``), the z-lab convention. Also, for every loader
  (:func:`build_export_config` says which reads what): ``rope_theta`` + ``rope_scaling`` (transformers 4.x) next
  to ``rope_parameters`` (5.x); ``eagle_aux_hidden_state_layer_ids`` (vLLM's capture points, = layer ids + 1);
  ``layer_types`` / ``use_sliding_window`` / ``sliding_window`` / ``is_causal: false``; ``auto_map``.
* ``modeling_dflash.py``: the drafter as a standalone transformers model (checkpoint/modeling_dflash.py), so
  ``AutoModel.from_pretrained(dir, trust_remote_code=True)`` builds it with the same outputs as load_export's.
* ``model.safetensors``: ``layers.*``, ``fc.weight`` [H, n*H], ``hidden_norm.weight``, ``norm.weight``; no
  ``model.`` prefix, no embedding, no lm_head (both are the target's), bf16 by default.
* the target tokenizer (``AutoTokenizer.save_pretrained``), so the directory is self-contained.
* ``dflash_dist_meta.json``: provenance for this project (source checkpoint, step, the job's target section)
  so ``dflash-eval --export`` can rebuild the same target. Serving engines ignore it.

``load_export(dir)`` reads such a directory (ours, or a z-lab release with default RoPE) back into a
:class:`~dflash_dist.model.drafter.DFlashDrafter`; it refuses one of ours that lacks any field above
(:func:`export_problems`, also ``dflash-doctor --export DIR``) and any attention setting a loader would read
differently from how the drafter was trained (causal or windowed layers that one loader or another would not
apply).

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
           "load_export", "export_problems", "mask_token_string", "ExportError", "META_NAME", "MODELING_NAME"]


META_NAME = "dflash_dist_meta.json"


META_FORMAT = "dflash_dist.export/1"


MODELING_NAME = "modeling_dflash.py"
"""The standalone modeling file copied into every export (``auto_map`` names its DFlashDraftModel)."""

AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}

MODELING_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), MODELING_NAME)

SGLANG_DEFAULT_MASK_TOKEN = "<|MASK|>"
"""SGLang's ``DEFAULT_DFLASH_MASK_TOKEN`` (python/sglang/srt/speculative/dflash_utils.py)."""


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


def mask_token_string(tokenizer: Any, mask_token_id: int) -> str:
    """The string SGLang's DFlash worker should find for ``mask_token_id`` in ``dflash_config.mask_token``.

    SGLang (python/sglang/srt/speculative/dflash_worker.py ``_resolve_mask_token_id``) with a ``mask_token_id``
    refuses a ``mask_token`` whose tokenizer id differs; versions that read only the string look it up in the
    tokenizer and, when absent, add it as a special token (id ``len(tokenizer)``). So: the id's own token when the
    tokenizer has one; ``<|MASK|>`` (SGLang's default) for the first id past the tokenizer (the spare embedding
    row ``job.resolve_mask_token_id`` falls back to) when the tokenizer lacks ``<|MASK|>``; otherwise no string
    names the id and the export is refused."""
    mid = int(mask_token_id)
    vocab = tokenizer.get_vocab()
    if mid < len(tokenizer):
        tok = tokenizer.convert_ids_to_tokens(mid)
        if isinstance(tok, str) and tok and vocab.get(tok) == mid:
            return tok
        raise ExportError(f"mask_token_id={mid}: the tokenizer's token for it ({tok!r}) does not map back to it")
    if mid == len(tokenizer) and SGLANG_DEFAULT_MASK_TOKEN not in vocab:
        return SGLANG_DEFAULT_MASK_TOKEN
    raise ExportError(f"mask_token_id={mid} has no token in the tokenizer ({len(tokenizer)} tokens) and is not the "
                      f"next id: SGLang resolves the mask token by its string and would pick another id; train with "
                      f"drafter.mask_token_id < {len(tokenizer) + 1}")


def build_export_config(drafter_config: DrafterModelConfig, target_config: dict, layer_ids: list,
                        mask_token_id: int, block_size: int, dtype: str = "bfloat16",
                        mask_token: str = SGLANG_DEFAULT_MASK_TOKEN) -> dict:
    """The z-lab ``config.json`` of a drafter trained on a target whose HF config dict is ``target_config``;
    ``mask_token``: :func:`mask_token_string` of the target tokenizer."""
    dc = drafter_config
    tc = _text_config_dict(dict(target_config))
    layer_ids = [int(i) for i in layer_ids]
    num_target_layers = _check_export_inputs(dc, tc, layer_ids, mask_token_id, block_size, dtype, mask_token)
    # the key order is the file's: every group below appends its keys to what came before
    cfg = _qwen3_fields(dc)
    cfg.update(_rope_fields(dc))
    cfg.update({k: tc.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    cfg.update(_dflash_fields(dc, layer_ids, num_target_layers, mask_token_id, mask_token, block_size))
    cfg.update(_attention_fields(dc))
    cfg.update({"auto_map": dict(AUTO_MAP), "torch_dtype": dtype, "dtype": dtype})
    return cfg


def _check_export_inputs(dc: DrafterModelConfig, tc: dict, layer_ids: list, mask_token_id: int, block_size: int,
                         dtype: str, mask_token: str) -> int:
    """The target's layer count, after refusing what no loader could serve as trained."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype={dtype!r}: use one of {sorted(DTYPES)}")
    num_target_layers = tc.get("num_hidden_layers")
    if num_target_layers is None:
        raise ExportError("the checkpoint's target_config has no num_hidden_layers")
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
    if "sliding_attention" in dc.kinds and int(dc.sliding_window) < int(block_size):
        raise ExportError(f"sliding_window={dc.sliding_window} < block_size={block_size}: every loader's window "
                          "would also cut the block")
    if not isinstance(mask_token, str) or not mask_token:
        raise ExportError(f"mask_token={mask_token!r}: must be the mask token's string")
    if not 0 <= int(mask_token_id) < dc.vocab_size:
        raise ExportError(f"mask_token_id={mask_token_id} is outside the vocabulary (size {dc.vocab_size})")
    return int(num_target_layers)


def _qwen3_fields(dc: DrafterModelConfig) -> dict[str, Any]:
    """The drafter's sizes as a Qwen3Config: every loader (z-lab, transformers, vLLM, SGLang) builds from these."""
    return {
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


def _rope_fields(dc: DrafterModelConfig) -> dict[str, Any]:
    """The drafter's RoPE under the keys of transformers 4.x (rope_theta, rope_scaling) and of 5.x, vLLM and
    SGLang (rope_parameters)."""
    # model/rope.py: the target's rope type and scaling through transformers' own init functions. transformers
    # 4.x Qwen3Config (the z-lab reference pins 4.57.1) reads top-level rope_theta (default 10000, wrong for
    # Qwen3's 1e6) and rope_scaling (None = default RoPE); 5.x lets a rope_scaling dict replace rope_parameters
    # (modeling_rope_utils convert_rope_params_to_dict), so the two say the same.
    rope = dc.rope_params()
    return {
        "rope_theta": float(dc.rope_theta),
        "rope_scaling": None if rope["rope_type"] == "default" else {k: v for k, v in rope.items()
                                                                     if k != "rope_theta"},
        "rope_parameters": rope,
    }


def _dflash_fields(dc: DrafterModelConfig, layer_ids: list, num_target_layers: int, mask_token_id: int,
                   mask_token: str, block_size: int) -> dict[str, Any]:
    """The DFlash fields: dflash_config (z-lab, SGLang, newer vLLM) and eagle_aux_hidden_state_layer_ids (vLLM)."""
    # vLLM's capture points: vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config
    # reads eagle_aux_hidden_state_layer_ids as is (versions before the DFlash fallback read nothing else and would
    # capture the target model's default 3 layers: qwen3_dflash.py sizes fc from len(aux_layers)); the target
    # records aux state at the INPUT of layer idx (`if idx in self.aux_hidden_state_layers:
    # aux_hidden_states.append(hidden_states + residual)` before layer idx runs, models/llama.py, qwen2.py), and
    # newer vLLM converts dflash_config.target_layer_ids with "+ 1": z-lab id i (output of layer i) = aux id i+1.
    aux_ids = [i + 1 for i in layer_ids]
    if max(aux_ids) >= num_target_layers:
        log.warning("target layer %d (the last) in layer_ids: vLLM's aux capture runs before each layer, so "
                    "aux id %d is never captured there", num_target_layers - 1, num_target_layers)
    dflash_config = {"mask_token_id": int(mask_token_id), "mask_token": mask_token, "target_layer_ids": layer_ids,
                     "block_size": int(block_size)}
    sliding = [t == "sliding_attention" for t in dc.kinds]
    if any(sliding):
        # vLLM qwen3_dflash.py _resolve_layer_attention: dflash_config.use_swa forces SWA on every layer of an
        # all-full layer_types; written for all-sliding drafters only (true) so a loader reading only use_swa is
        # right whenever it can be
        dflash_config["use_swa"] = all(sliding)
    return {
        "num_hidden_layers": dc.num_layers,
        "num_target_layers": num_target_layers,
        "block_size": int(block_size),
        "dflash_config": dflash_config,
        "eagle_aux_hidden_state_layer_ids": aux_ids,
    }


def _attention_fields(dc: DrafterModelConfig) -> dict[str, Any]:
    """Attention per layer as the z-lab model, vLLM and SGLang read it (layer_types, sliding_window, is_causal)."""
    # z-lab dflash/model.py Qwen3DFlashAttention: layer_types[i], config.sliding_window, is_causal; vLLM
    # qwen3_dflash.py: layer_types, sliding_window, is_causal wins over "sliding layers are causal"; SGLang
    # dflash_utils.get_dflash_attention_sliding_window_size: layer_types + sliding_window. transformers'
    # Qwen3Config keeps sliding_window only with use_sliding_window (configuration_qwen3.py __post_init__).
    # is_causal false: the drafter is non-causal.
    sliding = [t == "sliding_attention" for t in dc.kinds]
    if any(sliding) and not all(sliding):
        log.warning("mixed sliding/full drafter layers: vLLM serves them only with its V2 model runner "
                    "(VLLM_USE_V2_MODEL_RUNNER=1; vllm/model_executor/models/qwen3_dflash.py refuses otherwise)")
    return {
        "layer_types": dc.kinds,
        "use_sliding_window": any(sliding),
        "sliding_window": int(dc.sliding_window) if any(sliding) else None,
        "max_window_layers": dc.num_layers,
        "use_cache": False,
        "is_causal": False,
    }


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
    if (cfg.get("auto_map") or {}).get("AutoModel") != AUTO_MAP["AutoModel"]:
        out.append(f"auto_map.AutoModel is not {AUTO_MAP['AutoModel']!r} (AutoModel(trust_remote_code) would build "
                   "a plain Qwen3Model)")
    if path is not None and not os.path.exists(os.path.join(path, MODELING_NAME)):
        out.append(f"no {MODELING_NAME} (auto_map names it)")
    if cfg.get("is_causal") is not False:
        out.append("is_causal is not false (vLLM and the z-lab model make sliding layers causal unless told)")
    return out


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
    )


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
    tok_src = tokenizer_path or meta.get("tokenizer")
    tok = _load_tokenizer(tok_src)  # for the mask token's string even with tokenizer=False
    cfg = build_export_config(dcfg, meta["target_config"], meta["layer_ids"], meta["mask_token_id"],
                              meta["block_size"], dtype, mask_token=mask_token_string(tok, meta["mask_token_id"]))
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
        shutil.copyfile(MODELING_SOURCE, os.path.join(tmp, MODELING_NAME))
        if tokenizer:
            tok.save_pretrained(tmp)
        job = meta.get("job_config") or {}
        side = {"format": META_FORMAT, "source_checkpoint": os.path.abspath(checkpoint_dir),
                "step": meta.get("step"), "final": meta.get("final"), "cursor": meta.get("cursor"),
                "layer_ids": list(meta["layer_ids"]), "mask_token_id": int(meta["mask_token_id"]),
                "block_size": int(meta["block_size"]), "drafter_config": meta["drafter_config"],
                "target": job.get("target"), "data": job.get("data"), "tokenizer_source": tok_src,
                "dtype": dtype, "chat_template_kwargs": meta.get("chat_template_kwargs",
                                                                 (job.get("data") or {}).get("chat_template_kwargs", {}))}
        with open(os.path.join(tmp, META_NAME), "w") as f:
            json.dump(side, f, indent=1)
        # read back what a consumer reads: names/shapes of the file against the config in the file
        from safetensors import safe_open
        with safe_open(os.path.join(tmp, "model.safetensors"), "pt") as f:
            back = {k: f.get_slice(k) for k in f.keys()}
            validate_export_tensors({k: _Shape(s.get_shape()) for k, s in back.items()}, cfg)
        with open(os.path.join(tmp, "config.json")) as f:
            problems = export_problems(json.load(f), tmp)
        if problems:
            raise ExportError("the export is incomplete: " + "; ".join(problems))
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


def _load_tokenizer(tok_src: Optional[str]):
    if not tok_src:
        raise ExportError("the checkpoint meta names no tokenizer: pass --tokenizer PATH (it gives the mask token's "
                          "string, dflash_config.mask_token, even with --no-tokenizer)")
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(tok_src)
    except Exception as e:
        raise ExportError(f"cannot load the tokenizer {tok_src!r} ({type(e).__name__}: {e}); pass --tokenizer PATH "
                          "(needed for dflash_config.mask_token, also with --no-tokenizer)") from e


class _Shape:
    def __init__(self, shape):
        self.shape = tuple(shape)


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
    with open(cfg_path) as f:
        cfg = json.load(f)
    arch = cfg.get("architectures") or []
    if "DFlashDraftModel" not in arch:
        raise ExportError(f"{path}: architectures={arch}, expected DFlashDraftModel")
    if require_complete is None:
        require_complete = os.path.exists(os.path.join(path, META_NAME))
    problems = export_problems(cfg, path) if require_complete else []
    if problems:
        raise ExportError(f"{path}: incomplete export (re-export it with this version of dflash-export): "
                          + "; ".join(problems))
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
            side = json.load(f)
        for k in ("target", "data", "source_checkpoint", "step", "tokenizer_source", "chat_template_kwargs"):
            meta[k] = side.get(k)
    return model, meta
