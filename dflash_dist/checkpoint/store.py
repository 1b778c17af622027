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
from dflash_dist.storage import WRITE_ERRORS, errno_of

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


def state_bytes(state) -> int:
    """Bytes of the tensors in a (nested) state dict: about what its file takes on disk."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def checkpoint_bytes(path: str) -> int:
    """Bytes of a checkpoint directory's files (0 when it is gone)."""
    try:
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                   if os.path.isfile(os.path.join(path, f)))
    except OSError:
        return 0


class CheckpointSaveError(CheckpointError):
    """A save that failed (disk full, quota, file size limit, I/O error); the previous checkpoint is intact."""

    def __init__(self, message: str, errno_: Optional[int], needed: int, fix: str = ""):
        super().__init__(message)
        self.errno, self.needed, self.fix = errno_, needed, fix


def save_failure(path: str, e: BaseException, needed: int) -> CheckpointSaveError:
    """A one-line account of a failed save: the path, the errno, the bytes needed and free."""
    import errno as errno_mod
    code = errno_of(e)
    name = errno_mod.errorcode.get(code, "no errno") if code is not None else "no errno"
    cause = {errno_mod.ENOSPC: "the disk is full", errno_mod.EDQUOT: "the disk quota is exceeded",
             errno_mod.EFBIG: "a file grew past the file size limit (ulimit -f)",
             errno_mod.EIO: "an I/O error on the storage"}.get(code, "the write failed")
    root = os.path.dirname(os.path.dirname(path))
    fix = {errno_mod.EFBIG: f"raise the file size limit (ulimit -f) to more than {needed} bytes",
           errno_mod.EIO: f"check the storage of {root}"}.get(code,
                                                               f"free at least {needed} bytes on the disk of {root}")
    try:
        free = f"{shutil.disk_usage(os.path.dirname(path)).free} bytes free there"
    except OSError:
        free = "free space unknown"
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    return CheckpointSaveError(f"saving checkpoint {path} failed: {cause} (errno {code} {name}: {first}); it needs "
                               f"about {needed} bytes, {free}", code, needed, fix)


def save_checkpoint(output_dir: str, step: int, model_state: dict, optimizer_state: Optional[dict],
                    meta: dict, keep: int = 2) -> str:
    """Write one checkpoint atomically; returns its directory. Only one rank (the leader) calls this. A failed
    write (any OSError, torch's RuntimeError around one, safetensors' own error) removes the temporary directory
    and raises ``CheckpointSaveError``; the earlier checkpoints are untouched (pruning runs only after a complete
    save)."""
    root = checkpoint_root(output_dir)
    final = os.path.join(root, f"step_{step:08d}")
    tmp = os.path.join(root, f".tmp_step_{step:08d}_{os.getpid()}")
    needed = state_bytes(model_state) + state_bytes(optimizer_state) + 65536
    try:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        _write_files(tmp, model_state, optimizer_state, meta, step)
        if os.path.exists(final):  # same step saved twice (e.g. signal right after a periodic save)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except WRITE_ERRORS as e:  # safetensors' own error type too
        shutil.rmtree(tmp, ignore_errors=True)
        raise save_failure(final, e, needed) from e
    _prune(root, keep)
    return final


def _write_files(tmp: str, model_state: dict, optimizer_state: Optional[dict], meta: dict, step: int) -> None:
    """The checkpoint's files into ``tmp``, fsynced. torch.save writes through a Python file, so that an OSError
    (ENOSPC, EFBIG...) keeps its errno (a path would give only a RuntimeError of its C++ writer)."""
    from safetensors.torch import save_file
    weights = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
    save_file(weights, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    files = ["model.safetensors"]
    if optimizer_state is not None:
        with open(os.path.join(tmp, "optimizer.pt"), "wb") as f:
            torch.save(optimizer_state, f)
        files.append("optimizer.pt")
    meta = dict(meta, step=step, files={f: os.path.getsize(os.path.join(tmp, f)) for f in files})
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    for name in files + ["meta.json"]:
        _fsync_file(os.path.join(tmp, name))
    _fsync_dir(tmp)


def space_problem(output_dir: str, needed: int) -> Optional[str]:
    """Why the next save may not fit (free space below ``needed`` bytes), or None."""
    root = checkpoint_root(output_dir)
    try:
        free = shutil.disk_usage(root if os.path.isdir(root) else output_dir).free
    except OSError:
        return None
    if free >= needed:
        return None
    return (f"{free} bytes free on the disk of {root}, the next checkpoint needs about {needed} (the size of the "
            f"last one): free space there now, or the save will fail")


def remove_stale_tmp(output_dir: str) -> list:
    """Remove the temporary directories of saves that never finished (a crash, a kill): the caller holds the run
    directory's claim, so no save of another job is under way there. Returns what was removed."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    gone = [os.path.join(root, d) for d in sorted(os.listdir(root)) if d.startswith(".tmp_step_")]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


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


def usable_problem(path: str) -> Optional[str]:
    """checkpoint_problem, and a meta.json that is not a JSON object (``[1]``) or that checkpoint_problem cannot
    read is a problem too (said, never raised: resume=auto goes on to an older checkpoint)."""
    from dflash_dist.checkpoint.safe_io import MAX_JSON_BYTES, regular_file
    try:
        if os.path.lexists(os.path.join(path, "meta.json")):   # a FIFO would block the read
            regular_file(path, os.path.join(path, "meta.json"), MAX_JSON_BYTES)
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        if not isinstance(meta, dict):
            return f"meta.json holds a {type(meta).__name__}, not a JSON object"
    except CheckpointError as e:
        return str(e)
    except (OSError, ValueError):
        pass  # checkpoint_problem names it
    try:
        return checkpoint_problem(path)
    except Exception as e:  # a meta.json of the wrong shape
        return f"unusable meta.json ({type(e).__name__}: {e})"


def find_latest(output_dir: str) -> Optional[str]:
    """Newest complete checkpoint; partial or corrupt ones are skipped with a warning naming them."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return None
    for d in sorted((d for d in os.listdir(root) if STEP_RE.match(d)), reverse=True):
        path = os.path.join(root, d)
        problem = usable_problem(path)
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
