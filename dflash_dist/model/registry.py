"""Name -> class registries of the drafter's pluggable parts (variants, objectives).

A config names a part by its registered name (``dflash``) or as ``package.module:ClassName``: importing that module
is enough, so a part written outside this package (a test, a user's plugin on PYTHONPATH) reaches every rank of a
torchrun job without an edit here.
"""

from __future__ import annotations

import importlib

from dflash_dist.config import ConfigError

__all__ = ["Registry"]


class Registry:
    """The classes of one kind of part, by name; ``key`` is the config key that names one (for errors)."""

    def __init__(self, kind: str, key: str):
        self.kind, self.key = kind, key
        self._classes: dict[str, type] = {}

    def register(self, cls: type) -> type:
        """Class decorator: registers ``cls`` under ``cls.name``."""
        name = getattr(cls, "name", None)
        if not name:
            raise ValueError(f"a {self.kind} class needs a 'name' attribute to be registered")
        known = self._classes.get(name)
        if known is not None and known is not cls:
            raise ValueError(f"two {self.kind}s are named {name!r}: {known.__qualname__} and {cls.__qualname__}")
        self._classes[name] = cls
        return cls

    def get(self, name: str) -> type:
        """The class named ``name`` (a registered name, or ``package.module:ClassName``)."""
        if name in self._classes:
            return self._classes[name]
        if ":" in name:
            module, _, attr = name.partition(":")
            try:
                cls = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as e:
                raise ConfigError(f"{self.key}={name!r}: cannot import it ({type(e).__name__}: {e})") from e
            return cls
        raise ConfigError(f"{self.key}={name!r}: unknown {self.kind}; known: {sorted(self._classes)} "
                          "(or package.module:ClassName)")

    def names(self) -> list[str]:
        return sorted(self._classes)
