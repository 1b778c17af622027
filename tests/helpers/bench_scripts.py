"""Import a script of bench/ as a module (bench/ is not a package), for the bench scripts' own tests."""

import importlib.util
import os

from helpers.launch_util import REPO


def load_bench(name: str):
    """``bench/<name>.py`` as a fresh module."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
