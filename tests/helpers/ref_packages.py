"""Reference implementations for parity tests, installed once into a side directory and reused.

``install(name, packages)`` runs ``pip install --no-deps --target`` into ``<root>/<name>``, root =
``$DFLASH_TEST_REFS``, else ``$XDG_CACHE_HOME`` or ``~/.cache``, then ``dflash_dist_test_refs/``. The directory
goes last on ``sys.path``, so the venv's own packages win; a ``.complete`` marker makes the install happen once.
"""

import os
import subprocess
import sys

import pytest


def refs_root() -> str:
    return os.environ.get("DFLASH_TEST_REFS") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dflash_dist_test_refs")


def install(name: str, packages: list[str]) -> str:
    """The side directory holding ``packages`` (installed on first use), on sys.path."""
    target = os.path.join(refs_root(), name)
    if not os.path.exists(os.path.join(target, ".complete")):
        tmp = f"{target}.tmp{os.getpid()}"
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", tmp, *packages]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            pytest.fail(f"could not install the reference ({' '.join(cmd)}): {run.stderr[-2000:]}")
        open(os.path.join(tmp, ".complete"), "w").close()
        try:
            os.rename(tmp, target)                       # another run may have finished first: keep theirs
        except OSError:
            subprocess.run(["rm", "-rf", tmp], check=False)
    if target not in sys.path:
        sys.path.append(target)                          # last: the venv's own packages win
    return target
