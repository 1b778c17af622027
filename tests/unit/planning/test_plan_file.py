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


def _plan(tmp_path, **split_fields):
    split = split_from_rehearsals(3, [rehearsal(1, 2, 21.0), rehearsal(2, 1, 11.0)])
    split.update(split_fields)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"tool": "dflash-plan", "mode": "rehearsal", "splits": [split]}))
    return str(path)


@pytest.mark.parametrize("field, value, needle", [
    ("target_ranks", "2", r"splits\[world_size=3\].target_ranks='2': a whole number from 0 \(colocated\) to 2"),
    ("target_ranks", 1.9, r"target_ranks=1.9: a whole number"),
    ("target_ranks", True, r"target_ranks=True: a whole number"),
    ("target_ranks", 3, r"target_ranks=3: a whole number from 0 \(colocated\) to 2"),
    ("target_ranks", -1, r"target_ranks=-1"),
    ("drafter_ranks", 100, r"drafter_ranks=100: 2 \(the 3 ranks less its 1 target ranks\)"),
    ("drafter_ranks", "2", r"drafter_ranks='2'"),
    ("predicted_samples_per_s", "fast", r"predicted_samples_per_s='fast': a positive number"),
    ("predicted_samples_per_s", 0, r"predicted_samples_per_s=0"),
    ("rows", [{"targets": "1"}], r"\.rows="),
    ("bottleneck", 3, r"bottleneck=3"),
])
def test_a_plan_value_of_the_wrong_type_or_range_is_refused_in_one_line(tmp_path, field, value, needle):
    """Every value of the plan's split the job uses is typed and checked against the world size: one line, the
    field and what is allowed, before any rank uses it (the job check of dflash-train reads the plan too)."""
    with pytest.raises(ConfigError, match=needle) as e:
        split_from_plan_file(_plan(tmp_path, **{field: value}), 3)
    assert "\n" not in str(e.value) and "dflash-plan --gpus 3" in str(e.value)


def test_a_plan_file_that_is_not_a_plan_is_refused(tmp_path):
    path = tmp_path / "plan.json"
    for text, needle in (("[1, 2]", "expected an object"), ('{"splits": "x"}', "'splits' is not a list"),
                         ('{"splits": [{"world_size": 3.0}]}', r"no split for 3 ranks \(the plan has \[3.0\]\)"),
                         ('{"splits": [{"world_size": true}]}', "no split for 1 ranks"),
                         ('{"splits": [], "x": NaN}', "not a finite number")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=needle):
            split_from_plan_file(str(path), 1 if "true" in text else 3)
    good = _plan(tmp_path)
    plan = json.loads(open(good).read())
    plan["supply"] = {"samples_per_s": "many"}
    path.write_text(json.dumps(plan))
    with pytest.raises(ConfigError, match="supply=.*samples_per_s and tokens_per_s"):
        split_from_plan_file(str(path), 3)


def test_colocated_plan_takes_every_rank(tmp_path):
    res = split_from_plan_file(_plan(tmp_path, target_ranks=0, drafter_ranks=3), 3)
    assert (res["target_ranks"], res["drafter_ranks"]) == (0, 3)
    with pytest.raises(ConfigError, match=r"drafter_ranks=2: 3 "):
        split_from_plan_file(_plan(tmp_path, target_ranks=0, drafter_ranks=2), 3)


def test_dflash_train_refuses_a_bad_plan_before_any_rank_starts(tmp_path, capsys):
    from dflash_dist.cli.train import main
    rc = main(["--nproc-per-node", "3", "--cfg", "job", "topology.target_ranks=auto",
               f"topology.plan={_plan(tmp_path, drafter_ranks=100)}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and "configuration error: topology.plan=" in err[0] and "drafter_ranks=100" in err[0]
