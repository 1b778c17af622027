"""Training objectives of the drafter: labels, per-position weights, loss kind and normaliser (``drafter.loss.*``).

An objective is one object built from the resolved drafter description (``DrafterSpec.make_objective``): the
trainer calls it for a group's loss on the drafter, and a target rank serving ``drafter.tuning.loss_on_target``
calls the same object for the rows it is sent (comm/head_offload.py only moves tensors). It names its step
statistics (``stat_slots``) and turns their all-reduced sums into the window's metrics. docs/design.md, "Adding an
objective", lists what a new one touches.
"""

from __future__ import annotations

from dflash_dist.model.objectives.base import Objective, SlotWeightedCE
from dflash_dist.model.objectives.decayed_ce import DecayedCE, paper_gamma
from dflash_dist.model.objectives.registry import OBJECTIVES

__all__ = ["OBJECTIVES", "Objective", "SlotWeightedCE", "DecayedCE", "objective_class", "paper_gamma"]


def objective_class(name: str) -> type:
    """The class ``drafter.loss.objective`` names: a registered one (the built-in ones are, by this
    package's import) or ``package.module:ClassName``."""
    return OBJECTIVES.get(name)
