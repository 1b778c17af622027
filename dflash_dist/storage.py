"""Writes that fail because of the storage (a full disk, a quota, ``ulimit -f``, a read-only file system): one
line naming the path and the errno instead of a traceback. The first writes of a job (the run directory's claim,
run.json and config.json, the tokenized data cache, metrics.jsonl, the startup report) run inside
:func:`writing`, which turns such a failure into a :class:`StorageError` (a ConfigError: printed once, exit 2,
like a setting to change). A failure with another errno (a bug, a missing file) is left as it is."""

from __future__ import annotations

import errno as errno_mod
import os
import re
import shutil
from contextlib import contextmanager
from typing import Iterator, Optional

from dflash_dist.config import ConfigError

CAUSES = {errno_mod.ENOSPC: "the disk is full", errno_mod.EDQUOT: "the disk quota is exceeded",
          errno_mod.EFBIG: "a file grew past the file size limit (ulimit -f)",
          errno_mod.EROFS: "the file system is read-only"}


WRITE_ERRORS: tuple = (OSError, RuntimeError)  # torch's writer wraps an OSError in a RuntimeError
try:  # safetensors' writer (Rust) raises its own type, naming the errno in its message ("os error 27")
    from safetensors import SafetensorError
    WRITE_ERRORS += (SafetensorError,)
except ImportError:
    pass


class StorageError(ConfigError):
    """A write the storage refused (``CAUSES``); the message names the path, the errno and what to do."""

    kind = "disk error"


def os_error_of(e: BaseException) -> Optional[OSError]:
    """The OSError behind a failed write: itself, or the one torch's RuntimeError wrapped (its context)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        e = e.__cause__ or e.__context__
    return None


def errno_of(e: BaseException) -> Optional[int]:
    """The errno of a failed write (safetensors, in Rust, names it in its message only), or None."""
    ose = os_error_of(e)
    if ose is not None:
        return ose.errno
    m = re.search(r"os error (\d+)|Errno (\d+)", str(e))
    return int(m.group(1) or m.group(2)) if m else None


def storage_error(path: str, what: str, e: BaseException) -> Optional[StorageError]:
    """A StorageError for ``e`` when the storage refused the write (``CAUSES``), else None. ``path``: the file
    or directory being written (the OSError's own file name when it has one)."""
    code = errno_of(e)
    if code not in CAUSES:
        return None
    ose = os_error_of(e)
    path = str(getattr(ose, "filename", None) or path)
    try:
        free = f"{shutil.disk_usage(os.path.dirname(path) or '.').free} bytes free there"
    except OSError:
        free = "free space unknown"
    fix = ("raise the file size limit (ulimit -f)" if code == errno_mod.EFBIG else
           "make it writable or set another train.output_dir" if code == errno_mod.EROFS else
           "free space there or set train.output_dir on another disk")
    return StorageError(f"cannot write {path} ({what}): {CAUSES[code]} (errno {code} {errno_mod.errorcode[code]}); "
                        f"{free}; {fix}")


@contextmanager
def writing(path: str, what: str) -> Iterator[None]:
    """Run the writes of ``what`` (to ``path``): a storage failure becomes one StorageError line."""
    try:
        yield
    except WRITE_ERRORS as e:
        err = storage_error(path, what, e)
        if err is None:
            raise
        raise err from None
