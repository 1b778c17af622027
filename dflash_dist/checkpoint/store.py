"""Atomic, resumable checkpoints.

``<output_dir>/checkpoints/step_00000100/`` holds ``model.safetensors`` (drafter weights under the z-lab
names), ``optimizer.pt`` and ``meta.json`` (step, global data cursor, sample accounting, sizes of the
other files). Everything is written into a temporary directory, fsynced, then renamed: a crash mid-save
leaves the previous checkpoint untouched, and a directory without a consistent ``meta.json`` is skipped
with a warning on resume.

Nothing is unpickled with code: ``optimizer.pt`` (the optimizer's ``state_dict``: tensors and plain Python
values) is read with ``torch.load(weights_only=True)``, so a checkpoint from elsewhere whose pickle names a
callable is refused (``CheckpointError``) instead of run. Export and evaluation never open ``optimizer.pt``.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
from typing import Optional

import torch

from dflash_dist.checkpoint.safe_io import CheckpointError  # noqa: F401  (store's callers import it from here)

log = logging.getLogger(__name__)
STEP_RE = re.compile(r"^step_(\d{8})$")


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def save_checkpoint(output_dir: str, step: int, model_state: dict, optimizer_state: Optional[dict],
                    meta: dict, keep: int = 2) -> str:
    """Write one checkpoint atomically; returns its directory. Only one rank (the leader) calls this."""
    from safetensors.torch import save_file
    root = checkpoint_root(output_dir)
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"step_{step:08d}")
    tmp = os.path.join(root, f".tmp_step_{step:08d}_{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    weights = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
    save_file(weights, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    files = ["model.safetensors"]
    if optimizer_state is not None:
        torch.save(optimizer_state, os.path.join(tmp, "optimizer.pt"))
        files.append("optimizer.pt")
    meta = dict(meta, step=step, files={f: os.path.getsize(os.path.join(tmp, f)) for f in files})
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    for name in files + ["meta.json"]:
        _fsync_file(os.path.join(tmp, name))
    _fsync_dir(tmp)
    if os.path.exists(final):  # same step saved twice (e.g. signal right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    _prune(root, keep)
    return final


def _prune(root: str, keep: int) -> None:
    steps = sorted(d for d in os.listdir(root) if STEP_RE.match(d))
    for d in steps[:-keep]:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def checkpoint_problem(path: str, optimizer: bool = True) -> Optional[str]:
    """Why a checkpoint directory is unusable (one line naming the file and field), or None if every file checks
    out (checkpoint/validate.py: meta.json's schema and sizes, the files it lists, the safetensors header and,
    with ``optimizer``, the structure of optimizer.pt)."""
    from dflash_dist.checkpoint.validate import check_checkpoint, check_optimizer_state
    try:
        meta, header = check_checkpoint(path)
        if optimizer and "optimizer.pt" in meta["files"]:  # memory-mapped: its structure, not its tensors
            check_optimizer_state(os.path.join(path, "optimizer.pt"), load_optimizer_state(path, mmap=True), header)
    except CheckpointError as e:
        return str(e)
    except OSError as e:
        return f"unreadable ({e})"
    return None


def find_latest(output_dir: str) -> Optional[str]:
    """Newest complete checkpoint; partial or corrupt ones are skipped with a warning naming them."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return None
    for d in sorted((d for d in os.listdir(root) if STEP_RE.match(d)), reverse=True):
        path = os.path.join(root, d)
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def load_optimizer_state(path: str, map_location="cpu", mmap: bool = False) -> dict:
    """``optimizer.pt`` of a checkpoint directory, unpickled with ``weights_only=True`` (tensors and plain
    values only): a file that names any other callable or class raises ``CheckpointError`` before it runs, and so
    does a file that is no torch.save archive. ``mmap``: tensors are mapped, not read (a structure check)."""
    file = os.path.join(path, "optimizer.pt")
    try:
        return torch.load(file, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"checkpoint {path}: refusing to load optimizer.pt: it holds more than tensors and plain Python values "
            f"(torch.load weights_only=True: {first[:300]}). dflash_dist never writes such a file; a checkpoint "
            f"you did not write can run code this way. Resume only from checkpoints you trust; its weights "
            f"(model.safetensors) still export and evaluate (dflash-export, dflash-eval never read optimizer.pt)."
        ) from e
    except (RuntimeError, ValueError, EOFError, KeyError, OSError) as e:
        raise CheckpointError(f"{file}: file: not a torch.save archive ({str(e).splitlines()[0][:200]})") from None


def load_checkpoint(path: str, map_location="cpu", optimizer: bool = True) -> tuple[dict, Optional[dict], dict]:
    """(weights, optimizer state or None, meta) of a checkpoint whose files all check out (checkpoint_problem).
    ``optimizer=False``: the optimizer file is not opened at all (export, evaluation). Raises ``CheckpointError``
    (a ValueError)."""
    from safetensors.torch import load_file

    from dflash_dist.checkpoint.validate import check_checkpoint, check_optimizer_state
    try:
        meta, header = check_checkpoint(path)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {path} is unusable: {e}") from None
    weights = load_file(os.path.join(path, "model.safetensors"))
    opt = None
    if optimizer and "optimizer.pt" in meta["files"]:
        opt = load_optimizer_state(path, map_location)
        check_optimizer_state(os.path.join(path, "optimizer.pt"), opt, header)
    return weights, opt, meta
