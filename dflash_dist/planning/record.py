"""The ``kind: plan`` record of metrics.jsonl (and wandb) for a measured split."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the split arithmetic (bench/plan_split.py) runs without torch
    pass


log = logging.getLogger("dflash_dist")


def plan_record(res: dict) -> dict:
    """The metrics.jsonl record (kind "plan"); its numbers go to wandb as plan/<key>. A plan from dflash-plan
    (topology.plan) carries what it measured: rehearsed splits have no separate supply/demand measurement."""
    rec = {"world_size": res["world_size"], "target_ranks": res["target_ranks"],
           "drafter_ranks": res["drafter_ranks"], "measured": bool(res.get("measured"))}
    if res.get("source"):
        rec["source"] = res["source"]
    if res.get("measured"):
        rec.update({"predicted_samples_per_s": res["predicted_samples_per_s"], "bottleneck": res["bottleneck"],
                    "near_tie": bool(res.get("near_tie")),
                    "splits": [{k: r[k] for k in ("targets", "drafters", "samples_per_s", "bottleneck")}
                               for r in res["rows"]]})
        if "calibration_s" in res:
            rec["calibration_s"] = res["calibration_s"]
        for side in ("supply", "demand"):
            m = res.get(side)
            if m:
                rec.update({f"{side}_samples_per_s": m["samples_per_s"], f"{side}_tokens_per_s": m["tokens_per_s"],
                            f"{side}_samples_per_s_min": m.get("samples_per_s_min"),
                            f"{side}_samples_per_s_max": m.get("samples_per_s_max")})
    return rec
