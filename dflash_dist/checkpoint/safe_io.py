"""Reading files of a directory from elsewhere without trusting them: plain names inside it, no symlink out of
it, every file read a regular file of bounded size (:func:`regular_file`: a FIFO would hang the reader, /dev/zero
fill memory), bounded JSON without NaN or infinity, a safetensors header checked against the file before
safetensors reads it, a model no larger than this machine could hold (:func:`check_model_size`), and hub locations
resolved from the local cache only. Every refusal is a :class:`CheckpointError` naming the file and the field."""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from typing import Any, Optional


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be used; the message says why."""


MAX_JSON_BYTES = 64 << 20
MAX_WEIGHTS_BYTES = 1 << 40        # model.safetensors, optimizer.pt: far above any drafter's
MAX_LOG_BYTES = 1 << 36            # metrics.jsonl
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")
MAX_HEADER_BYTES = 100 << 20       # safetensors' own limit
_ST_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                   "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def fail(file: str, field: str, why: str) -> CheckpointError:
    return CheckpointError(f"{file}: {field}: {why}")


# ---------------------------------------------------------------------------------------------- files

def inside(directory: str, name: Any, field: str = "files") -> str:
    """Path of the plain file ``name`` of ``directory``; refuses other names and symlinks that leave it."""
    if (not isinstance(name, str) or name in ("", ".", "..") or name != os.path.basename(name)
            or "\\" in name or "\0" in name):
        raise fail(os.path.join(directory, "meta.json"), field, f"{name!r} is not a plain file name of the "
                   "checkpoint directory")
    path = os.path.join(directory, name)
    check_link(directory, path)
    return path


def check_link(directory: str, path: str) -> None:
    """Refuse ``path`` when it is a symlink that resolves outside ``directory``."""
    if os.path.islink(path):
        root = os.path.realpath(directory)
        real = os.path.realpath(path)
        if os.path.commonpath([root, real]) != root:
            raise fail(path, "file", f"a symlink to {real}, outside the directory {root}: refusing to read it")


def regular_file(directory: str, path: str, max_bytes: int, contained: bool = True) -> int:
    """The size of ``path``, a file of ``directory``: a symlink must stay inside it (unless not ``contained``: a
    Hugging Face cache snapshot links into the cache's blobs), and what it names must be a regular file (not a
    FIFO, device, socket or directory) of at most ``max_bytes``. Checked before any read."""
    if contained:
        check_link(directory, path)
    try:
        st = os.stat(path)   # follows a symlink (inside the directory); never opens, so a FIFO cannot block
    except OSError as e:
        raise fail(path, "file", "missing" if isinstance(e, FileNotFoundError) else f"unreadable ({e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise fail(path, "file", "not a regular file (a FIFO, device, socket or directory): refusing to read it")
    if st.st_size > max_bytes:
        raise fail(path, "file", f"{st.st_size} bytes: larger than any such file this project writes "
                   f"({max_bytes})")
    return st.st_size


def check_entries(directory: str) -> None:
    """Every entry of an export directory: no symlink out of it, nothing a reader could block on or be flooded by
    (each a regular file of bounded size; a directory is never read), the tokenizer files transformers reads
    bounded as JSON."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        check_link(directory, path)
        if not os.path.isdir(path):
            regular_file(directory, path, MAX_JSON_BYTES if name in TOKENIZER_FILES else MAX_WEIGHTS_BYTES)


def check_tokenizer_files(directory: str) -> None:
    """The tokenizer files (and config.json) of a local location a file named (a directory or a cache snapshot)
    that exist are regular files of bounded size: transformers reads them."""
    for name in TOKENIZER_FILES + ("config.json",):
        path = os.path.join(directory, name)
        if os.path.lexists(path):
            regular_file(directory, path, MAX_JSON_BYTES, contained=False)


def read_json(directory: str, name: str) -> dict:
    """A JSON object file of ``directory`` (a regular file of bounded size, symlinks out of the directory
    refused, no NaN or infinity)."""
    path = os.path.join(directory, name)
    regular_file(directory, path, MAX_JSON_BYTES)
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise fail(path, "file", f"unreadable JSON ({str(e)[:200]})") from None
    if not isinstance(obj, dict):
        raise fail(path, "file", f"a JSON {type(obj).__name__}, expected an object")
    bad = nonfinite_field(obj)
    if bad is not None:
        raise fail(path, bad[0], f"{bad[1]!r} is not a finite number")
    return obj


def nonfinite_field(obj: Any, field: str = "") -> Optional[tuple[str, float]]:
    """(dotted field, value) of the first NaN or infinite number in a parsed JSON value, or None. Python's json
    reads NaN, Infinity and 1e999; no file this project writes holds one."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return field or "value", obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        bad = nonfinite_field(v, f"{field}[{k}]" if isinstance(k, int) else f"{field}.{k}" if field else str(k))
        if bad is not None:
            return bad
    return None


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def safetensors_header(path: str) -> dict[str, tuple[str, tuple]]:
    """{name: (dtype, shape)} of a safetensors file (a regular file of bounded size), its header checked against
    the file's size first."""
    size = regular_file(os.path.dirname(path), path, MAX_WEIGHTS_BYTES)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise fail(path, "header", f"{size} bytes: too short for a safetensors file")
        n = struct.unpack("<Q", head)[0]
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise fail(path, "header length", f"{n} bytes in a {size}-byte file (the limit is "
                       f"{MAX_HEADER_BYTES}): not a safetensors file")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise fail(path, "header", f"not JSON ({str(e)[:120]})") from None
    if not isinstance(header, dict):
        raise fail(path, "header", "not a JSON object")
    data_len = size - 8 - n
    out, ends = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise fail(path, "header.__metadata__", "not an object of strings")
            continue
        out[name] = _tensor_entry(path, name, entry, data_len)
        ends.append(tuple(entry["data_offsets"]))
    ends.sort()
    for (a0, a1), (b0, _) in zip(ends, ends[1:]):
        if b0 < a1:
            raise fail(path, "header", "tensors overlap in the file")
    return out


def _tensor_entry(path: str, name: str, entry: Any, data_len: int) -> tuple[str, tuple]:
    field = f"header[{name!r}]"
    if not isinstance(entry, dict):
        raise fail(path, field, "not an object")
    dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _ST_DTYPE_BYTES:
        raise fail(path, field + ".dtype", f"{dtype!r} is not a safetensors dtype")
    if not isinstance(shape, list) or len(shape) > 8 or not all(is_int(d) and 0 <= d < 1 << 40 for d in shape):
        raise fail(path, field + ".shape", f"{str(shape)[:80]} is not a list of sizes")
    if (not isinstance(offs, list) or len(offs) != 2 or not all(is_int(o) for o in offs)
            or not 0 <= offs[0] <= offs[1] <= data_len):
        raise fail(path, field + ".data_offsets", f"{str(offs)[:80]} is outside the file's {data_len} data bytes")
    if offs[1] - offs[0] != math.prod(shape) * _ST_DTYPE_BYTES[dtype]:
        raise fail(path, field, f"shape {shape} of {dtype} does not fill data_offsets {offs}")
    return dtype, tuple(shape)


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def check_model_size(file: str, field: str, cfg: dict, layers_key: str = "num_hidden_layers") -> None:
    """Refuse a config of a model that would be built (a drafter, a random-init target) whose parameters (a
    Qwen-style decoder of these sizes, at 2 bytes each) exceed this machine's memory: every size may be within its
    bound while their product is not (1024 layers x intermediate 2^19 x hidden 2^16)."""
    cfg = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg   # multimodal wrappers

    def n(key, default=0):
        return cfg[key] if is_int(cfg.get(key)) and cfg[key] > 0 else default
    h, layers, heads = n("hidden_size", 1), n(layers_key, 1), n("num_attention_heads", 1)
    kv, head_dim = n("num_key_value_heads", heads), n("head_dim", max(h // heads, 1))
    mlp = max(n("intermediate_size"), n("num_experts") * n("moe_intermediate_size"))
    params = (layers * (2 * h * head_dim * (heads + kv) + 3 * h * mlp) + 2 * n("vocab_size") * h
              + n("num_feature_layers") * h * h)
    if 2 * params > _memory_bytes():
        raise fail(file, field, f"{layers} layers, hidden {h}, intermediate {mlp}: about {params:.3g} parameters, "
                   f"{2 * params / 2**30:.0f} GiB at 2 bytes each, more than this machine's "
                   f"{_memory_bytes() / 2**30:.0f} GiB of memory: refusing to build it")


def local_dir(location: str, probe: str) -> Optional[str]:
    """The directory to load a location read from a file from: itself when it is a directory, else its snapshot
    in the local Hugging Face cache (``probe``: a file the snapshot must hold; found on disk, no network call),
    else None. Hub clients contact the Hub even with ``local_files_only=True``; a local directory they do not."""
    if os.path.isdir(location):
        return location
    try:
        from huggingface_hub import try_to_load_from_cache
        hit = try_to_load_from_cache(location, probe)
    except Exception:  # not a hub id either
        return None
    return os.path.dirname(hit) if isinstance(hit, str) else None
