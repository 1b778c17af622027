"""Roles, replicas and node-local routing (pure Python, no processes)."""

import pytest

from dflash_dist.comm.topology import Topology, TopologyError


def test_single_node_layout_is_unchanged_by_replicas_of_one():
    t = Topology(5, 0, 2)
    assert t.drafter_ranks == [0, 1, 2] and t.target_ranks == [3, 4] and t.feeders == [3, 4]
    assert [t.target_for(j) for j in range(4)] == [3, 4, 3, 4]
    assert [t.drafter_for(j) for j in range(4)] == [0, 1, 2, 0]
    assert Topology(5, 4, 2).index == 1 and Topology(5, 4, 2).is_feeder


def test_replicas_of_two_route_per_replica():
    t = Topology(7, 3, 4, tp=2)  # drafters 0..2, replicas [3,4], [5,6]
    assert t.replicas == [[3, 4], [5, 6]] and t.feeders == [3, 5] and t.num_replicas == 2
    assert [t.target_for(j) for j in range(4)] == [3, 5, 3, 5]
    assert Topology(7, 4, 4, tp=2).replica_rank == 1 and not Topology(7, 4, 4, tp=2).is_feeder
    assert list(Topology(7, 6, 4, tp=2).target_messages(6)) == [1, 3, 5]
    with pytest.raises(AssertionError):  # refused before, by config.check_split
        Topology(7, 0, 3, tp=2)


def test_node_local_every_message_stays_on_its_node():
    # 2 nodes x 8 ranks, 4 target ranks per node in replicas of 2, 4 drafters per node
    for rank in range(16):
        t = Topology(16, rank, 8, tp=2, nodes=2)
        assert t.node_local
    t = Topology(16, 0, 8, tp=2, nodes=2)
    assert t.drafter_ranks == [0, 8, 1, 9, 2, 10, 3, 11]
    assert t.replicas == [[4, 5], [12, 13], [6, 7], [14, 15]]
    assert not any(t.crosses_nodes(j) for j in range(1000))
    assert "node 1: drafter ranks [8, 9, 10, 11]" in t.describe()
    for r in t.replicas:  # a replica stays within a node
        assert len({x // 8 for x in r}) == 1


def test_a_split_that_cannot_be_node_local_is_refused_or_crosses_on_request():
    with pytest.raises(TopologyError, match="cannot be node-local: 3 target ranks do not split evenly over 2"):
        Topology(8, 0, 3, nodes=2)
    with pytest.raises(TopologyError, match="per node do not form replicas"):
        Topology(8, 0, 2, tp=2, nodes=2)  # one target rank per node, replicas of 2
    t = Topology(8, 0, 3, nodes=2, cross_node=True)
    assert t.drafter_ranks == [0, 1, 2, 3, 4] and t.target_ranks == [5, 6, 7]
    assert any(t.crosses_nodes(j) for j in range(10)) and "NOT node-local" in t.describe()
    with pytest.raises(TopologyError, match="would span nodes"):
        Topology(10, 0, 6, tp=2, nodes=2, cross_node=True)  # replica [4, 5]: rank 4 on node 0, rank 5 on node 1
