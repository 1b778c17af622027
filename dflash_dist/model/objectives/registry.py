"""The registry of objectives (``drafter.loss.objective``)."""

from __future__ import annotations

from dflash_dist.model.registry import Registry

OBJECTIVES = Registry("objective", "drafter.loss.objective")

