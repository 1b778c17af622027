"""The standalone ``modeling_dflash.py`` an export carries, assembled from the variants' serving parts.

Each variant's folder holds its part (``serving_source``): the base DFlash part is a whole module (torch and
transformers only, no dflash_dist import); another variant's part is the text after its :data:`MARKER` line,
appended to the base part and using its names. Every export carries the base part and the parts of every variant
this package ships, in the registry's order (so the file is the same whichever built-in variant an export holds,
and byte for byte the one earlier exports carry), then the part of its own variant when that one comes from
outside the package.
"""

from __future__ import annotations

import os

__all__ = ["MODELING_NAME", "MARKER", "modeling_source", "serving_parts", "write_modeling"]

MODELING_NAME = "modeling_dflash.py"
"""The standalone modeling file copied into every export (``auto_map`` names its classes)."""

MARKER = "# ---- modeling_dflash.py: exported from the next line on ----\n"
"""The line after which a variant's serving part is appended (what comes before it is for the reader)."""


def serving_parts(variant) -> list[str]:
    """The serving parts (paths) an export of ``variant`` assembles, in order."""
    from dflash_dist.model.variants import DFlash, registered_variants
    parts = [DFlash.serving_source]
    for v in registered_variants():
        if type(v).__module__.startswith("dflash_dist.") and v.serving_source and v.serving_source not in parts:
            parts.append(v.serving_source)
    if variant.serving_source and variant.serving_source not in parts:
        parts.append(variant.serving_source)
    return parts


def _part_text(path: str, first: bool) -> str:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if first:
        return text
    head, sep, body = text.partition(MARKER)
    if not sep:
        raise ValueError(f"{path}: a variant's serving part needs the line {MARKER.strip()!r} before its code")
    return body


def modeling_source(variant) -> str:
    """The text of the ``modeling_dflash.py`` an export of ``variant`` carries."""
    return "".join(_part_text(p, i == 0) for i, p in enumerate(serving_parts(variant)))


def write_modeling(variant, directory: str) -> str:
    """Write :func:`modeling_source` as ``directory/modeling_dflash.py``; returns its path."""
    path = os.path.join(directory, MODELING_NAME)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(modeling_source(variant))
    return path
