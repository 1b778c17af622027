"""Drafter variants (``drafter.variant``): what a drafter adds to or changes in DFlash, in one module each.

A variant is a class of this registry (``dflash.DFlash`` is the default and the base every variant subclasses):
its model class (a ``DFlashDrafter`` subclass: extra weights in or after the layers, the proposal step, its own
loss terms), its FLOPs, its export fields and weight names, and its counterpart in the standalone
``modeling_dflash.py``. The trainer, the loops, evaluation and export ask it; none branches on a variant.
docs/design.md, "Adding a drafter variant", lists what a new one touches.
"""

from __future__ import annotations

from dflash_dist.model.variants.dflash import DFlash
from dflash_dist.model.variants.dflash2 import DFlash2
from dflash_dist.model.variants.domino import Domino
from dflash_dist.model.variants.registry import VARIANTS

__all__ = ["VARIANTS", "DFlash", "DFlash2", "Domino", "variant_class", "variant_of_export"]


def variant_class(name: str) -> type:
    """The class ``drafter.variant`` names: a registered one (the built-in ones are, by this
    package's import) or ``package.module:ClassName``."""
    return VARIANTS.get(name)


def variant_of_export(config: dict):
    """The variant (an instance) whose ``architecture`` an exported config.json names, or None."""
    archs = config.get("architectures") or []
    for name in VARIANTS.names():
        cls = VARIANTS.get(name)
        if cls.architecture in archs:
            return cls()
    return None
