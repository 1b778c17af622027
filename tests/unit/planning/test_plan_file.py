"""topology.plan: a job takes its split from a dflash-plan plan.json (planning/startup.py, config, record)."""

import json

import pytest

from dflash_dist.config import ConfigError, TopologyConfig
from dflash_dist.planning.record import plan_record
from dflash_dist.planning.rehearse import split_from_rehearsals
from dflash_dist.planning.startup import split_from_plan_file


def rehearsal(t, d, med):
    return {"targets": t, "drafters": d, "samples_per_s": med, "samples_per_s_min": med * 0.9,
            "samples_per_s_max": med * 1.1, "supply_per_rank": 40.0, "demand_per_rank": 11.0}


def test_the_split_for_the_world_size(tmp_path):
    splits = [split_from_rehearsals(2, [rehearsal(1, 1, 10.0)]),
              split_from_rehearsals(3, [rehearsal(1, 2, 21.0), rehearsal(2, 1, 11.0)])]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"tool": "dflash-plan", "mode": "rehearsal", "splits": splits}))
    res = split_from_plan_file(str(path), 3)
    assert (res["target_ranks"], res["drafter_ranks"], res["predicted_samples_per_s"]) == (1, 2, 21.0)
    rec = plan_record(res)
    assert rec["source"] == f"topology.plan={path}" and rec["predicted_samples_per_s"] == 21.0
    assert [s["targets"] for s in rec["splits"]] == [1, 2] and "supply_samples_per_s" not in rec
    with pytest.raises(ConfigError, match=r"no split for 4 ranks \(the plan has \[2, 3\]\); run dflash-plan --gpus 4"):
        split_from_plan_file(str(path), 4)
    with pytest.raises(ConfigError, match="topology.plan=.*cannot read a plan.json"):
        split_from_plan_file(str(tmp_path / "missing.json"), 3)


def test_a_plan_needs_target_ranks_auto():
    assert TopologyConfig(target_ranks="auto", plan="p.json").plan == "p.json"
    with pytest.raises(ConfigError, match="topology.plan=p.json: set topology.target_ranks=auto"):
        TopologyConfig(target_ranks=2, plan="p.json")
