"""The config's error and the checks every group's dataclass runs in ``__post_init__``."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal


class ConfigError(ValueError):
    """A configuration that cannot work. The message says which key to change and to what."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_choices(obj, section: str) -> None:
    """Every ``Literal[...]`` field of a config dataclass holds one of its choices (checked once, here)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        tp = hints[f.name]
        args = typing.get_args(tp) if typing.get_origin(tp) is not Literal else (tp,)
        for lit in [tp] + [a for a in args if typing.get_origin(a) is Literal]:
            if typing.get_origin(lit) is Literal:
                choices = typing.get_args(lit)
                allowed = choices + ((None,) if type(None) in args else ())
                v = getattr(obj, f.name)
                _require(v in allowed, f"{section}.{f.name}={v!r}: use one of {', '.join(map(str, choices))}")
                break


def _sub(value, cls, section: str):
    """A nested sub-group given as a dict (from YAML / Hydra) becomes its dataclass, unknown keys refused."""
    if isinstance(value, cls):
        return value
    value = dict(value or {})
    names = {f.name for f in dataclasses.fields(cls)}
    bad = set(value) - names
    _require(not bad, f"unknown keys {sorted(bad)} in '{section}'; known: {sorted(names)}")
    return cls(**value)
