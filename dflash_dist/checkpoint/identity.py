"""What a run (and each of its checkpoints) belongs to, recorded by content, never by this machine's paths.

``<run_dir>/run.json`` and every checkpoint's ``meta.json`` carry an ``identity``: one short content hash per
part, with a readable label beside it, so that a resume can name what differs:

* ``data``: the training data (the JSONL file's bytes, the packaged corpus, or a synthetic spec) and the data
  settings that change the samples (max_length, overlong, holdout, shuffle seed);
* ``tokenizer``: the tokenizer's files (tokenizer*.json, vocab, merges, chat template...);
* ``target``: the target's HF config (path-like and version keys left out) and, for a random-init target, its seed;
* ``drafter``: the drafter's shape (layers, block size, MLP width, feature layers, mask token) and, when not the
  default, its sliding window, variant, the variant's settings (``identity_fields``: e.g. every
  ``drafter.dflash2.*``), objective and loss weighting; its ``fields`` (config key: value) let a refused resume
  name the field that differs and both values;
* ``plan``: the batching plan of one epoch (sample lengths, seed, batch budgets): a resume replays the same order.

A resume (``train.resume=auto`` or a checkpoint path) goes on only when every part matches.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from dflash_dist.data.conversations import PACKAGED_SOURCES, builtin_conversations

PARTS = ("data", "tokenizer", "target", "drafter", "plan")

# what to look at when a part differs (the message of a refused resume)
PART_KEYS = {
    "data": "data.source (its content) and data.{max_length, overlong, holdout, shuffle_seed, chat_template_kwargs}",
    "tokenizer": "target.tokenizer (the tokenizer files' content)",
    "target": "target.name_or_path / target.hf_config / target.init_seed",
    "drafter": ("drafter.{variant, num_layers, block_size, intermediate_size, mask_token_id, layer_types, "
                "sliding_window, loss.objective, loss.weighting, loss.dpace_alpha, loss.labels, loss.kind, "
                "loss.kl_top_k}, the variant's section (drafter.<variant>.*), target.layer_ids"),
    "plan": "target.max_batch_tokens, target.max_batch_samples, data.sort_window_batches",
}

_TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "chat_template", "vocab", "merges", "added_tokens")
# keys of an HF config that name a place or a version, not the model
_HF_NON_IDENTITY = ("_name_or_path", "name_or_path", "transformers_version", "_commit_hash", "torch_dtype", "dtype",
                    "_attn_implementation", "_attn_implementation_autoset", "attn_implementation")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def tokenizer_hash(tok_path: str) -> str:
    """Hash of the tokenizer's files (a local directory), or of its name (a hub id: not on disk here)."""
    h = hashlib.sha256()
    if os.path.isdir(tok_path):
        for name in sorted(os.listdir(tok_path)):
            if name.startswith(_TOKENIZER_FILES) and os.path.isfile(os.path.join(tok_path, name)):
                h.update(name.encode() + b"\0" + file_sha256(os.path.join(tok_path, name)).encode())
    else:
        h.update(b"hub:" + str(tok_path).encode())
    return h.hexdigest()


def data_source_hash(source: str) -> str:
    """Hash of the training data's content: the JSONL file's bytes, the packaged corpus, a synthetic spec."""
    if source.startswith("synthetic:"):
        return _sha(source.encode())
    if source in PACKAGED_SOURCES:
        return _sha(json.dumps(builtin_conversations(source), sort_keys=True).encode())
    if os.path.isdir(source):  # a datasets save_to_disk directory: every file, by relative path and content
        h = hashlib.sha256()
        for root, dirs, files in os.walk(source):
            dirs.sort()
            for name in sorted(files):
                path = os.path.join(root, name)
                h.update(os.path.relpath(path, source).encode() + b"\0" + file_sha256(path).encode())
        return h.hexdigest()
    return file_sha256(source)


def data_identity(cfg, tok_path: str, vocab: int) -> dict:
    """The ``data`` and ``tokenizer`` parts (before anything is tokenized: also the data cache's key)."""
    d = cfg.data
    settings = [d.max_length, d.overlong, d.holdout, d.shuffle_seed, int(vocab),
                sorted((getattr(d, "chat_template_kwargs", None) or {}).items())]
    label = d.source if d.source in PACKAGED_SOURCES else d.source if d.source.startswith("synthetic:") \
        else os.path.basename(d.source)
    data = _sha(json.dumps([data_source_hash(d.source), settings], default=repr).encode())
    return {"data": {"hash": data[:16], "label": f"{label}, max_length {d.max_length}, holdout {d.holdout}, "
                                                 f"seed {d.shuffle_seed}"},
            "tokenizer": {"hash": tokenizer_hash(tok_path)[:16], "label": os.path.basename(os.path.normpath(tok_path))}}


def target_identity(cfg, hf_config) -> dict:
    cfg_dict = {k: v for k, v in hf_config.to_dict().items() if k not in _HF_NON_IDENTITY}
    t = cfg.target
    random_init = not t.name_or_path and not (t.hf_config or {}).get("builtin")
    # an FP8 target (target.quantization) computes other features: in the hash only when set, bf16 runs keep theirs
    quant = [t.quantization] if getattr(t, "quantization", None) else []
    blob = json.dumps([cfg_dict, t.init_seed if random_init else None] + quant, sort_keys=True, default=repr)
    if t.name_or_path:
        label = os.path.basename(os.path.normpath(str(t.name_or_path)))
    elif (t.hf_config or {}).get("builtin"):
        label = f"builtin {t.hf_config['builtin']}"
    else:
        label = f"random-init {cfg_dict.get('model_type', '?')} (seed {t.init_seed})"
    return {"hash": _sha(blob.encode())[:16], "label": label + (f", quantized {quant[0]} on load" if quant else "")}


def drafter_identity(cfg, layer_ids: list, mask_token_id: int, hidden_size: int) -> dict:
    dc = cfg.drafter
    shape = {"num_layers": dc.num_layers, "block_size": dc.block_size, "intermediate_size": dc.intermediate_size,
             "layer_ids": list(layer_ids), "mask_token_id": int(mask_token_id), "hidden_size": int(hidden_size)}
    if dc.variant != "dflash":  # in the hash only when not the default: DFlash runs from before keep theirs
        shape["variant"] = dc.variant
    if "sliding_attention" in (dc.layer_types or []):  # likewise only when some layer slides
        shape["layer_types"], shape["sliding_window"] = list(dc.layer_types), int(dc.sliding_window)
    from dflash_dist.model.variants import variant_class
    settings = variant_class(str(dc.variant))().identity_fields(dc)  # the variant's own, by config key
    if settings:
        shape["variant_settings"] = settings
    loss, supervision = dc.loss, ""
    if loss.labels != "data" or loss.kind != "ce":  # likewise: runs on the data's labels keep their hash
        shape["labels"], shape["loss_kind"] = loss.labels, loss.kind
        if loss.kind == "kl":
            shape["kl_top_k"] = int(loss.kl_top_k)
        supervision = f", labels {loss.labels}, loss {loss.kind}" + (
            f" top-{loss.kl_top_k}" if loss.kind == "kl" else "")
    if loss.objective != "decayed_ce":  # the objective and its weighting: likewise only when not the default
        shape["objective"] = loss.objective
    if loss.weighting != "decay":
        shape["weighting"] = {"weighting": loss.weighting, "dpace_alpha": float(loss.dpace_alpha)}
    objective = "" if loss.objective == "decayed_ce" and loss.weighting == "decay" else (
        f", objective {loss.objective}" + (f" with D-PACE weights (alpha {loss.dpace_alpha:g})"
                                           if loss.weighting == "dpace" else ""))
    label = (f"{dc.variant} drafter, {dc.num_layers} layers, block {dc.block_size}, features of layers "
             f"{list(layer_ids)}, mask {mask_token_id}{objective}{supervision}")
    return {"hash": _sha(json.dumps(shape, sort_keys=True, default=repr).encode())[:16], "label": label,
            "fields": json.loads(json.dumps(_drafter_fields(shape, dc, settings), default=repr))}


def _drafter_fields(shape: dict, dc, settings: dict) -> dict:
    """What the drafter's hash covers, by config key: each entry the hash leaves out at its default is shown
    with its default (null where it does not apply), so two records' fields differ exactly when their hashes do."""
    loss = dc.loss
    return {"drafter.variant": str(dc.variant), "drafter.num_layers": shape["num_layers"],
            "drafter.block_size": shape["block_size"], "drafter.intermediate_size": shape["intermediate_size"],
            "target.layer_ids": shape["layer_ids"], "drafter.mask_token_id": shape["mask_token_id"],
            "the target's hidden_size": shape["hidden_size"], "drafter.layer_types": shape.get("layer_types"),
            "drafter.sliding_window": shape.get("sliding_window"), "drafter.loss.labels": str(loss.labels),
            "drafter.loss.kind": str(loss.kind), "drafter.loss.kl_top_k": shape.get("kl_top_k"),
            "drafter.loss.objective": str(loss.objective), "drafter.loss.weighting": str(loss.weighting),
            "drafter.loss.dpace_alpha": (shape.get("weighting") or {}).get("dpace_alpha"), **settings}


def field_differences(a: dict, b: dict) -> list[str]:
    """The fields of two records of a part (their ``fields``: config key -> value) that differ, with both values:
    those both record first (a variant's settings follow from its name: a changed variant is named alone)."""
    fa, fb = a.get("fields"), b.get("fields")
    if not (isinstance(fa, dict) and isinstance(fb, dict)):
        return []
    both = [k for k in fb if k in fa and fa[k] != fb[k]]
    keys = both or [k for k in list(fa) + [k for k in fb if k not in fa] if (k in fa) != (k in fb)]
    return [f"{k} is {_value(fa, k)} in the run, {_value(fb, k)} in this job" for k in keys]


def _value(fields: dict, key: str, width: int = 80) -> str:
    text = json.dumps(fields[key]) if key in fields else "not recorded"
    return text if len(text) <= width else text[:width - 3] + "..."  # a record someone else wrote: one line


def plan_identity(epoch_plan: list) -> dict:
    """Hash of the first epoch's batches: later epochs follow from the same inputs (data.batching.build_plan)."""
    return {"hash": _sha(json.dumps(epoch_plan).encode())[:16], "label": f"{len(epoch_plan)} messages per epoch"}


def differences(recorded: Optional[dict], now: dict, parts=PARTS) -> list[str]:
    """Readable differences between a recorded identity and this job's (the parts present in ``now``)."""
    if not recorded:
        return ["it records no identity (written by an older dflash_dist): its data, target and drafter "
                "cannot be checked"]
    if not isinstance(recorded, dict):
        return [f"its identity is a {type(recorded).__name__}, not an object: it cannot be checked"]
    out = []
    for p in parts:
        if p not in now:
            continue
        a, b = recorded.get(p), now[p]
        if a is not None and not (isinstance(a, dict) and isinstance(a.get("hash"), str)):
            a = {"label": "an unreadable record", "hash": None}
        if a is None or a.get("hash") != b.get("hash"):
            was = f"{a.get('label')} [{a.get('hash')}]" if a else "nothing recorded"
            named = "; ".join(field_differences(a, b)) if a else ""
            out.append(f"{p}: {named + '; ' if named else ''}the run has {was}, this job {b.get('label')} "
                       f"[{b.get('hash')}] (see {PART_KEYS[p]})")
    return out


RUN_JSON = "run.json"


def read_run_json(run_dir: str) -> Optional[dict]:
    """The run's ``run.json`` (a JSON object), or None when absent or unreadable (not a regular file of bounded
    size included: a FIFO would block the read)."""
    from dflash_dist.checkpoint.safe_io import MAX_JSON_BYTES, regular_file
    try:
        regular_file(run_dir, os.path.join(run_dir, RUN_JSON), MAX_JSON_BYTES)
        with open(os.path.join(run_dir, RUN_JSON)) as f:
            rec = json.load(f)
    except (OSError, ValueError, RecursionError):   # CheckpointError is a ValueError
        return None
    return rec if isinstance(rec, dict) else None


def write_run_json(run_dir: str, identity: dict, extra: Optional[dict] = None) -> None:
    os.makedirs(run_dir, exist_ok=True)
    tmp = os.path.join(run_dir, f".{RUN_JSON}.tmp")
    with open(tmp, "w") as f:
        json.dump(dict(extra or {}, identity=identity), f, indent=1)
    os.replace(tmp, os.path.join(run_dir, RUN_JSON))


# files and folders that make a directory "a run's"
RUN_MARKERS = (RUN_JSON, "metrics.jsonl", "config.json", "checkpoints")


def run_markers(run_dir: str) -> list[str]:
    return [m for m in RUN_MARKERS if os.path.exists(os.path.join(run_dir, m))]
