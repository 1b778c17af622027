"""The scaling model of docs/scaling.md (dflash_dist/planning/scaling.py)."""

import pytest

from dflash_dist.planning.scaling import Setup, evaluate, main, table


def test_one_node_8b_reproduces_the_measured_projection():
    s = Setup()
    r = evaluate(s, 8, s.targets[0], True)
    assert (r["targets"], r["drafters"]) == (2, 6)  # docs/benchmarks.md: 2 + 6 at 94.0 samples/s
    assert r["samples_per_s"] == pytest.approx(94.0, rel=1e-3) and r["allreduce_exposed_ms"] == 0


def test_node_local_routing_never_crosses_and_global_does():
    s = Setup()
    local = evaluate(s, 64, s.targets[0], True)
    glob = evaluate(s, 64, s.targets[0], False)
    assert local["cross_fraction"] == 0 and local["features_nic_per_node_gb_s"] == 0
    assert glob["cross_fraction"] > 0.9 and glob["features_nic_per_node_gb_s"] > 0


def test_a_whole_node_replica_cannot_be_node_local():
    s = Setup()
    r = evaluate(s, 64, s.targets[1], True)  # 235B-A22B, k=8 on 8-GPU nodes
    assert not r["feasible"] and "leaves no drafter" in r["why"]
    assert evaluate(s, 64, s.targets[1], False)["feasible"]


def test_tables_print(capsys):
    assert len(table(Setup())) == 15
    assert main([]) == 0
    assert "measured: docs/benchmarks.md" in capsys.readouterr().out
