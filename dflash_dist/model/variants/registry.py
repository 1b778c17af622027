"""The registry of drafter variants (``drafter.variant``)."""

from __future__ import annotations

from dflash_dist.model.registry import Registry

VARIANTS = Registry("drafter variant", "drafter.variant")

