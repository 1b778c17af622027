"""Drafter variants (``drafter.variant``): what a drafter adds to or changes in DFlash, in one folder each.

A variant is a class of this registry (``dflash/variant.DFlash`` is the default and the base every variant
subclasses), in its own folder ``model/variants/<name>/``: ``variant.py`` (the class on the seam: its model class,
a ``DFlashDrafter`` subclass with extra weights in or after the layers, the proposal step and its own loss terms;
its FLOPs, memory, export fields, weight names and export checks), the modules of its math, and ``serving.py``
(its part of the standalone ``modeling_dflash.py`` an export carries). The trainer, the loops, evaluation, the
export and the validators ask it; none names or branches on a variant. docs/design.md, "Adding a drafter
variant", lists what a new one touches.
"""

from __future__ import annotations

from dflash_dist.model.variants.dflash.variant import DFlash
from dflash_dist.model.variants.dflash2.variant import DFlash2
from dflash_dist.model.variants.domino.variant import Domino
from dflash_dist.model.variants.registry import VARIANTS

__all__ = ["VARIANTS", "DFlash", "DFlash2", "Domino", "variant_class", "variant_of_export", "registered_variants"]


def variant_class(name: str) -> type:
    """The class ``drafter.variant`` names: a registered one (the built-in ones are, by this
    package's import) or ``package.module:ClassName``."""
    return VARIANTS.get(name)


def registered_variants() -> list:
    """An instance of every registered variant, by name: the export's checks ask each (each answers only for a
    config of its own)."""
    return [VARIANTS.get(name)() for name in VARIANTS.names()]


def variant_of_export(config: dict, by_fields: bool = False):
    """The variant (an instance) whose ``architecture`` an exported config.json names, or None; ``by_fields``:
    failing that, the variant whose fields the config carries (its ``claims_export``)."""
    archs = config.get("architectures") or []
    for name in VARIANTS.names():
        cls = VARIANTS.get(name)
        if cls.architecture in archs:
            return cls()
    if by_fields:
        for variant in registered_variants():
            if variant.claims_export(config):
                return variant
    return None
