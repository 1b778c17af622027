"""The ``kind: plan`` record of metrics.jsonl (and wandb) for a measured split."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the split arithmetic (bench/plan_split.py) runs without torch
    pass


log = logging.getLogger("dflash_dist")


def plan_record(res: dict) -> dict:
    """The metrics.jsonl record (kind "plan"); its numbers go to wandb as plan/<key>."""
    rec = {"world_size": res["world_size"], "target_ranks": res["target_ranks"],
           "drafter_ranks": res["drafter_ranks"], "measured": bool(res.get("measured"))}
    if res.get("measured"):
        rec.update({"predicted_samples_per_s": res["predicted_samples_per_s"], "bottleneck": res["bottleneck"],
                    "supply_samples_per_s": res["supply"]["samples_per_s"],
                    "supply_tokens_per_s": res["supply"]["tokens_per_s"],
                    "demand_samples_per_s": res["demand"]["samples_per_s"],
                    "demand_tokens_per_s": res["demand"]["tokens_per_s"], "calibration_s": res["calibration_s"],
                    "supply_samples_per_s_min": res["supply"].get("samples_per_s_min"),
                    "supply_samples_per_s_max": res["supply"].get("samples_per_s_max"),
                    "demand_samples_per_s_min": res["demand"].get("samples_per_s_min"),
                    "demand_samples_per_s_max": res["demand"].get("samples_per_s_max"),
                    "near_tie": bool(res.get("near_tie")),
                    "splits": [{k: r[k] for k in ("targets", "drafters", "samples_per_s", "bottleneck")}
                               for r in res["rows"]]})
    return rec
