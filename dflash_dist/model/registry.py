"""Name -> class registries of the drafter's pluggable parts (variants, objectives).

A config names a part by its registered name (``dflash``) or as ``package.module:ClassName``: importing that module
is enough, so a part written outside this package (a test, a user's plugin on PYTHONPATH) reaches every rank of a
torchrun job without an edit here. Whatever ``module:ClassName`` names must be a subclass of the kind's base class
(:meth:`Registry.set_base`), checked before anything calls it: ``drafter.variant=os:getcwd`` is refused, not run.
A file (checkpoint, export) names a part through :meth:`Registry.get_named_in_file`, which never imports.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Optional

from dflash_dist.config import ConfigError

__all__ = ["Registry"]


class Registry:
    """The classes of one kind of part, by name; ``key`` is the config key that names one (for errors)."""

    def __init__(self, kind: str, key: str):
        self.kind, self.key = kind, key
        self._classes: dict[str, type] = {}
        self.base: Optional[type] = None

    def set_base(self, cls: type) -> type:
        """Class decorator: ``cls`` is the class every part of this kind subclasses."""
        self.base = cls
        return cls

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
            return self._checked(name, cls)
        raise ConfigError(f"{self.key}={name!r}: unknown {self.kind}; known: {sorted(self._classes)} "
                          "(or package.module:ClassName)")

    def get_named_in_file(self, name: Any) -> type:
        """The class a file names: a registered name, or ``module:ClassName`` of a module this program imported
        itself (a file never makes it import one: that would run the code it names), a subclass of the base."""
        if isinstance(name, str) and name in self._classes:
            return self._classes[name]
        if isinstance(name, str) and ":" in name and name.partition(":")[0] in sys.modules:
            module, _, attr = name.partition(":")
            return self._checked(name, getattr(sys.modules[module], attr, None))
        raise ConfigError(f"{name!r}: a file may name only the registered {self.kind}s ({', '.join(self.names())}); "
                          "one of your own is used only when your program imports its module")

    def _checked(self, name: str, obj: Any) -> type:
        """``obj`` when it is a class of this kind (a subclass of the base), else ConfigError; nothing is called."""
        if self.base is None or not (isinstance(obj, type) and issubclass(obj, self.base)):
            base = f"{self.base.__module__}.{self.base.__qualname__}" if self.base else "a registered base"
            raise ConfigError(f"{self.key}={name!r}: {str(obj)[:80]} is not a {self.kind} class (a subclass of "
                              f"{base}); refusing to use it")
        return obj

    def names(self) -> list[str]:
        return sorted(self._classes)
