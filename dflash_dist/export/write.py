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
* a variant's fields (its ``export_fields``, :func:`apply_variant_fields`): its ``architectures``, ``auto_map``
  class and ``dflash_config`` fields, checked by its ``export_problems`` (each variant's ``export_description``
  says what it adds; ``dflash-export --help`` lists them); its tensors (``export_names``).
* ``modeling_dflash.py``: the drafter as a standalone transformers model, assembled from the variants' serving
  parts (export/serving.py), so ``AutoModel.from_pretrained(dir, trust_remote_code=True)`` builds it with the
  same outputs as load_export's.
* ``model.safetensors``: ``layers.*``, ``fc.weight`` [H, n*H], ``hidden_norm.weight``, ``norm.weight``; no
  ``model.`` prefix, no embedding, no lm_head (both are the target's), bf16 by default.
* the target tokenizer (``AutoTokenizer.save_pretrained``), so the directory is self-contained.
* ``dflash_dist_meta.json``: provenance for this project (source checkpoint, step, the job's target section)
  so ``dflash-eval --export`` can rebuild the same target. Serving engines ignore it.

``load_export(dir)`` (export/load.py) reads such a directory (ours, or a z-lab release with default
RoPE) back into a :class:`~dflash_dist.model.drafter.DFlashDrafter`; it refuses one of ours that lacks any field
above (:func:`export_problems`, also ``dflash-doctor --export DIR``) and any attention setting a loader would read
differently from how the drafter was trained (causal or windowed layers that one loader or another would not
apply).

The directory is written into a temporary sibling and renamed, so an interrupted export leaves nothing that
looks complete. It also holds ``.dflash-export`` (:data:`EXPORT_MARKER`), a small JSON record: ``--overwrite``
replaces only a directory holding one, and no export is written to, over or into a checkpoint or run directory
(:func:`check_out_dir`): a typo in OUT_DIR never deletes a run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, Optional

import torch

from dflash_dist.checkpoint.claim import CLAIM_FILE
from dflash_dist.export.load import (
    META_NAME,
    CheckpointInputError,
    ExportError,
    check_variant_fields,
    config_tensor_shapes,
    drafter_config_from_export,
    export_problems,
    safetensors_shapes,
    validate_export_tensors,
)
from dflash_dist.checkpoint.identity import RUN_JSON
from dflash_dist.checkpoint.meta import meta_block_size, meta_variant
from dflash_dist.checkpoint.safe_io import check_tokenizer_files, local_dir
from dflash_dist.export.serving import write_modeling
from dflash_dist.checkpoint.store import CheckpointError
from dflash_dist.checkpoint.validate import bare_name, check_checkpoint
from dflash_dist.model.drafter import DrafterModelConfig
from dflash_dist.model.variants import variant_class, variant_of_export

log = logging.getLogger(__name__)


__all__ = ["export_checkpoint", "build_export_config", "apply_variant_fields", "mask_token_string", "DTYPES",
           "check_out_dir", "EXPORT_MARKER"]


META_FORMAT = "dflash_dist.export/1"

EXPORT_MARKER = ".dflash-export"
"""The file every export holds; ``--overwrite`` replaces only a directory that has it."""

_RUN_ENTRIES = (RUN_JSON, "checkpoints", CLAIM_FILE)   # any of them makes a directory a run directory


SGLANG_DEFAULT_MASK_TOKEN = "<|MASK|>"
"""SGLang's ``DEFAULT_DFLASH_MASK_TOKEN`` (python/sglang/srt/speculative/dflash_utils.py)."""


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
    row ``targets.hf.resolve_mask_token_id`` falls back to) when the tokenizer lacks ``<|MASK|>``; otherwise no string
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
                        mask_token: str = SGLANG_DEFAULT_MASK_TOKEN, variant: str = "dflash") -> dict:
    """The z-lab ``config.json`` of a drafter trained on a target whose HF config dict is ``target_config``;
    ``mask_token``: :func:`mask_token_string` of the target tokenizer; ``variant``: the drafter variant
    (``drafter.variant``), whose ``export_fields`` give ``architectures`` and its own ``dflash_config`` fields."""
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
    impl = variant_class(variant)()
    cfg.update({"auto_map": {"AutoModel": impl.auto_model}, "torch_dtype": dtype, "dtype": dtype})
    return apply_variant_fields(cfg, impl.export_fields(dc))


def apply_variant_fields(cfg: dict, fields: dict) -> dict:
    """``cfg`` with a variant's ``export_fields`` merged in: its ``architectures``, its ``dflash_config`` fields,
    its top-level fields; the config gets the ``auto_map`` class of the variant it then means (its ``auto_model``)
    and is refused when a variant's fields in it are not what both engines load (its ``export_problems``)."""
    cfg["architectures"] = list(fields.get("architectures", cfg["architectures"]))
    cfg["dflash_config"].update(fields.get("dflash_config") or {})
    cfg.update({k: v for k, v in fields.items() if k not in ("architectures", "dflash_config")})  # top level
    meant = variant_of_export(cfg, by_fields=True)
    if meant is not None:
        cfg["auto_map"] = {"AutoModel": meant.auto_model}
    check_variant_fields(cfg, "the {title} fields are not what both engines load: ")
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


def _strip_prefixes(weights: dict) -> dict:
    out = {}
    for k, v in weights.items():
        name = bare_name(k)
        if name in out:
            raise ExportError(f"two checkpoint tensors map to {name!r} after removing wrapper prefixes")
        out[name] = v
    return out


def _read_checkpoint(checkpoint_dir: str) -> tuple[dict, dict]:
    """(weights, meta) of a checkpoint whose files all check out (checkpoint/validate.py; optimizer.pt is never
    opened); its tensors' names and shapes are checked from the header before any is read."""
    from safetensors.torch import load_file
    if not os.path.isdir(checkpoint_dir):
        raise ExportError(f"{checkpoint_dir}: not a directory")
    try:
        meta, _ = check_checkpoint(checkpoint_dir)  # optimizer.pt is never opened
    except CheckpointError as e:
        raise CheckpointInputError(f"checkpoint {checkpoint_dir} is unusable: {e}") from None
    for key in ("layer_ids", "mask_token_id", "drafter_config", "target_config"):
        if key not in meta:
            raise CheckpointInputError(f"checkpoint {checkpoint_dir}: meta.json has no {key!r}")
    weights = load_file(os.path.join(checkpoint_dir, "model.safetensors"))
    return weights, meta


def export_checkpoint(checkpoint_dir: str, out_dir: str, dtype: str = "bfloat16", tokenizer: bool = True,
                      overwrite: bool = False, tokenizer_path: Optional[str] = None) -> str:
    """Write the z-lab layout of ``checkpoint_dir`` to ``out_dir``; returns ``out_dir``.

    ``tokenizer_path`` overrides the checkpoint meta's ``tokenizer`` (the meta's is read from a local directory or
    the local Hugging Face cache only). Refuses a checkpoint whose files do not check out (checkpoint/validate.py;
    ``CheckpointInputError``), a non-empty ``out_dir`` unless ``overwrite``, and tensors whose names/shapes do not
    match the config it writes.
    """
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: use one of {sorted(DTYPES)}")
    out_dir = os.path.abspath(out_dir)
    check_out_dir(out_dir, checkpoint_dir, overwrite)   # before anything is read
    weights, meta = _read_checkpoint(checkpoint_dir)
    dcfg = DrafterModelConfig(**meta["drafter_config"])
    tok_src = tokenizer_path or meta.get("tokenizer")
    tok = _load_tokenizer(tok_src, from_file=tokenizer_path is None,  # the mask token's string, also tokenizer=False
                          meta_path=os.path.join(checkpoint_dir, "meta.json"))
    variant = variant_class(meta_variant(meta))()
    cfg = build_export_config(dcfg, meta["target_config"], meta["layer_ids"], meta["mask_token_id"],
                              meta_block_size(meta), dtype, mask_token=mask_token_string(tok, meta["mask_token_id"]),
                              variant=meta_variant(meta))
    tensors = _export_tensors(weights, cfg, dtype, variant)

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp_export_{os.path.basename(out_dir)}_{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _write_export(tmp, tensors, cfg, _side_meta(meta, checkpoint_dir, tok_src, dtype),
                      tok if tokenizer else None, variant)
        with open(os.path.join(tmp, EXPORT_MARKER), "w") as f:
            json.dump({"format": META_FORMAT, "source_checkpoint": os.path.abspath(checkpoint_dir)}, f)
        _publish(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _training_dir_kind(path: str) -> Optional[str]:
    """'a run directory' or 'a checkpoint directory' when ``path`` is one, else None."""
    if any(os.path.lexists(os.path.join(path, n)) for n in _RUN_ENTRIES):
        return "a run directory"
    if all(os.path.lexists(os.path.join(path, n)) for n in ("meta.json", "model.safetensors")):
        return "a checkpoint directory"
    return None


def _within(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def check_out_dir(out_dir: str, checkpoint_dir: str, overwrite: bool) -> None:
    """Refuse (ExportError) an ``out_dir`` that is, holds or lies inside the checkpoint read or any checkpoint or
    run directory, whatever ``overwrite`` says; a non-empty one unless ``overwrite``, and then only an earlier
    export (it holds :data:`EXPORT_MARKER`): replacing it deletes what was there."""
    out, ckpt = os.path.realpath(out_dir), os.path.realpath(checkpoint_dir)
    if _within(out, ckpt) or _within(ckpt, out):
        raise ExportError(f"{out_dir}: is, holds or lies inside the checkpoint {checkpoint_dir} being exported: "
                          "choose an export directory outside it")
    d = out
    while True:
        kind = _training_dir_kind(d) if os.path.isdir(d) else None
        if kind:
            where = "is" if d == out else f"lies inside {d}, which is"
            raise ExportError(f"{out_dir} {where} {kind}: an export is never written into a training run's "
                              "directories; choose a directory outside them")
        if os.path.dirname(d) == d:
            break
        d = os.path.dirname(d)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ExportError(f"{out_dir} exists and is not a directory")
    if not (os.path.isdir(out) and os.listdir(out)):
        return
    if not overwrite:
        raise ExportError(f"{out_dir} is not empty: pass --overwrite to replace it (an earlier export only)")
    if not os.path.isfile(os.path.join(out, EXPORT_MARKER)):
        raise ExportError(f"{out_dir} is not an export of dflash-export (no {EXPORT_MARKER} in it): --overwrite "
                          "replaces only those; remove it yourself or choose another directory")
    for root, _, _ in os.walk(out):   # an earlier export with a run or checkpoint put inside it since
        kind = _training_dir_kind(root)
        if kind:
            raise ExportError(f"{out_dir} holds {kind} ({root}): --overwrite would delete it; move it out first")


def _validate_with_variant(tensors: dict, cfg: dict, variant) -> None:
    """The names and shapes the config implies (load.validate_export_tensors: DFlash's, and a variant's
    from its fields) and the variant's own beyond them."""
    known = config_tensor_shapes(cfg)
    extra = {k: v for k, v in variant.extra_tensor_shapes(cfg).items() if k not in known}
    validate_export_tensors({k: v for k, v in tensors.items() if k not in extra}, cfg)
    have = {k: tuple(v.shape) for k, v in tensors.items() if k in extra}
    if have != {k: tuple(s) for k, s in extra.items()}:
        raise ExportError(f"the {variant.name} tensors do not match the exported config: have {have}, want {extra}")


def _export_tensors(weights: dict, cfg: dict, dtype: str, variant) -> dict:
    """The checkpoint's drafter tensors under the export's names (the variant's ``export_names``), checked
    against ``cfg``, in ``dtype``."""
    tensors = variant.export_names(_strip_prefixes(weights))
    _validate_with_variant(tensors, cfg, variant)
    # the module must agree with the config too (the same check a consumer's strict load would do)
    with torch.device("meta"):
        ref = variant.export_names(variant.build(drafter_config_from_export(cfg), "sdpa").state_dict())
    _validate_with_variant(ref, cfg, variant)
    bad = [k for k, v in tensors.items() if not bool(torch.isfinite(v.float()).all())]
    if bad:
        raise ExportError(f"non-finite values in {bad[:6]}: refusing to export a diverged drafter")
    return {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in sorted(tensors.items())}


def _side_meta(meta: dict, checkpoint_dir: str, tok_src: Optional[str], dtype: str) -> dict:
    """The ``dflash_dist_meta.json`` of an export: where it came from and the job's target and data sections."""
    job = meta.get("job_config") or {}
    return {"format": META_FORMAT, "source_checkpoint": os.path.abspath(checkpoint_dir),
            "step": meta.get("step"), "final": meta.get("final"), "cursor": meta.get("cursor"),
            "layer_ids": list(meta["layer_ids"]), "mask_token_id": int(meta["mask_token_id"]),
            "block_size": meta_block_size(meta), "drafter_config": meta["drafter_config"],
            "drafter": meta.get("drafter"),
            "target": job.get("target"), "data": job.get("data"), "tokenizer_source": tok_src,
            "dtype": dtype, "chat_template_kwargs": meta.get("chat_template_kwargs",
                                                             (job.get("data") or {}).get("chat_template_kwargs", {}))}


def _write_export(tmp: str, tensors: dict, cfg: dict, side: dict, tok: Any, variant) -> None:
    """Every file of the export into ``tmp`` (the tokenizer's unless ``tok`` is None; the standalone module the
    variant's serving parts assemble as modeling_dflash.py), then read back as a consumer reads it."""
    from safetensors.torch import save_file
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    write_modeling(variant, tmp)
    if tok is not None:
        tok.save_pretrained(tmp)
    with open(os.path.join(tmp, META_NAME), "w") as f:
        json.dump(side, f, indent=1)
    # read back what a consumer reads: names/shapes of the file against the config in the file
    _validate_with_variant(safetensors_shapes(os.path.join(tmp, "model.safetensors")), cfg, variant)
    with open(os.path.join(tmp, "config.json")) as f:
        problems = export_problems(json.load(f), tmp)
    if problems:
        raise ExportError("the export is incomplete: " + "; ".join(problems))


def _publish(tmp: str, out_dir: str) -> None:
    """Rename the finished ``tmp`` to ``out_dir`` (replacing an old export there), readable by all."""
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


def _load_tokenizer(tok_src: Optional[str], from_file: bool, meta_path: str):
    """The tokenizer at ``tok_src``; one named by the checkpoint (``from_file``) only from a local directory or the
    local Hugging Face cache: a name from a file never reaches the network."""
    if not tok_src:
        raise ExportError("the checkpoint meta names no tokenizer: pass --tokenizer PATH (it gives the mask token's "
                          "string, dflash_config.mask_token, even with --no-tokenizer)")
    from transformers import AutoTokenizer
    where = local_dir(tok_src, "tokenizer_config.json") if from_file else tok_src
    if from_file and where is not None:
        try:
            check_tokenizer_files(where)   # a FIFO or /dev/zero link there would hang or flood the loader
        except CheckpointError as e:
            raise CheckpointInputError(f"{meta_path}: tokenizer: {e}") from None
    try:
        if where is None:
            raise FileNotFoundError("not a local directory and not in the local Hugging Face cache")
        return AutoTokenizer.from_pretrained(where, **({"local_files_only": True} if from_file else {}))
    except Exception as e:
        why = f"cannot load the tokenizer {tok_src!r} ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
        if from_file:
            raise CheckpointInputError(f"{meta_path}: tokenizer: {why}; a tokenizer named in a file is read only "
                                       "from a local directory or the local Hugging Face cache: pass --tokenizer "
                                       "PATH_OR_HUB_ID") from None
        raise ExportError(f"{why}; pass --tokenizer PATH (needed for dflash_config.mask_token, also with "
                          "--no-tokenizer)") from e
