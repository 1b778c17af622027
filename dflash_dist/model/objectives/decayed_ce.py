"""The DFlash paper's objective: CE on the data's labels, slot k >= 1 weighted exp(-(k-1)/gamma).

gamma 7 / 5 / 4 for B = 16 / 10 / 8 as in the paper (``drafter.loss.gamma`` overrides); normalised by the
weight sum of the whole step.
"""

from __future__ import annotations

from dflash_dist.model import loss as L
from dflash_dist.model.objectives.base import SlotWeightedCE
from dflash_dist.model.objectives.registry import OBJECTIVES

__all__ = ["DecayedCE", "PAPER_GAMMA", "paper_gamma"]

PAPER_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}
"""Loss decay gamma of the DFlash paper per block size (w_k = exp(-(k-1)/gamma))."""


def paper_gamma(block_size: int) -> float:
    """The paper's gamma for B = 8, 10, 16 (4, 5, 7). Any other B: NOT from the paper, a rule of this project:
    piecewise-linear interpolation through (8, 4), (10, 5), (16, 7), the end segments extended beyond them
    (slope 1/2 below 10, 1/3 above 10), floored at 1: B=12 -> 5.67, B=4 -> 2, B=2 -> 1, B=32 -> 12.33."""
    b = int(block_size)
    if b in PAPER_GAMMA:
        return PAPER_GAMMA[b]
    (b0, g0), (b1, g1) = ((8, 4.0), (10, 5.0)) if b < 10 else ((10, 5.0), (16, 7.0))
    return max(1.0, g0 + (b - b0) * (g1 - g0) / (b1 - b0))


@OBJECTIVES.register
class DecayedCE(SlotWeightedCE):
    name = "decayed_ce"

    def __init__(self, spec):
        super().__init__(spec)
        g = spec.loss.gamma
        self.gamma = float(g) if g is not None else paper_gamma(self.block_size)

    def slot_weights(self, device=None):
        return L.slot_weights(self.block_size, self.gamma, device=device)

    def describe(self) -> str:
        return super().describe() if self.weighting == "dpace" else f"decayed_ce (gamma {self.gamma:g})"
