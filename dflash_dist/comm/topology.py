"""Roles and routing.

Ranks are drafters or target ranks; the target ranks form *replicas* of ``tp`` ranks of one node
(``target.tensor_parallel``), each holding one copy of the target sharded by tensor parallelism. Every rank of a
replica runs the same messages; its first rank (the replica's *feeder*) sends the features.

Message j of a run (plan index k = start + j) goes from replica ``j mod R`` to drafter ``j mod D``. Every rank
handles its messages in increasing j, so the smallest pending j always has both ends ready: no deadlock for any
R:D, and every drafter gets every D-th message, so none idles while another has work. The plan itself never
depends on R, D or tp, which is what lets a run resume with another split or another tp.

Colocated (``num_targets`` 0): every rank holds both roles, a replica of its own and a drafter, so message j
is captured and trained on rank j mod W; its features never leave the rank (an in-process link, comm/local.py).

Layout. One node (or ``cross_node``): drafters are global ranks 0..D-1, the target ranks D..W-1, replica g the
ranks D+g*tp .. D+(g+1)*tp-1. Several nodes (node-local, the default): every node runs the same split, its local
ranks 0..d-1 drafters and d..L-1 target ranks (L = ranks per node), and the indices interleave over the nodes:
drafter i is local drafter i//N of node i%N, replica g local replica g//N of node g%N. Then message j's replica
(j%R) and drafter (j%D) are both on node j%N (N divides R and D): every feature stays on its node, and only the
drafters' data-parallel all-reduce spans the nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class TopologyError(ValueError):
    """A split that cannot be laid out (the reason is the message)."""


@dataclass(frozen=True)
class Topology:
    world_size: int
    rank: int
    num_targets: int
    tp: int = 1
    nodes: int = 1
    cross_node: bool = False

    def __post_init__(self) -> None:
        # a split the config refuses (config.check_split, before any topology is built) never gets here
        assert 0 <= self.num_targets < self.world_size, (self.num_targets, self.world_size)
        assert self.num_targets or self.tp == 1, "a colocated rank holds the whole target"
        assert self.tp >= 1 and self.num_targets % self.tp == 0, (self.num_targets, self.tp)
        if self.nodes < 1 or self.world_size % self.nodes:
            raise TopologyError(f"{self.world_size} ranks on {self.nodes} nodes: every node needs the same number "
                                "of ranks")
        object.__setattr__(self, "_layout", self._build())

    # ---- layout ----
    def node_local_problem(self) -> Optional[str]:
        """Why this split cannot run with every message on its node, or None."""
        n, L, t, k = self.nodes, self.ranks_per_node, self.num_targets, self.tp
        if n == 1:
            return None
        if t % n:
            return f"{t} target ranks do not split evenly over {n} nodes"
        if (t // n) % k:
            return (f"{t // n} target ranks per node do not form replicas of target.tensor_parallel={k} ranks")
        if t // n >= L:
            return f"{t // n} target ranks per node leave no drafter on a node of {L} ranks"
        return None

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes

    @property
    def node_local(self) -> bool:
        return self.nodes > 1 and self.node_local_problem() is None

    @property
    def colocated(self) -> bool:
        """Every rank captures its own messages and trains on them (no target-only or drafter-only rank)."""
        return self.num_targets == 0

    def _build(self) -> tuple:
        n, L, k = self.nodes, self.ranks_per_node, self.tp
        if self.colocated:
            ranks = list(range(self.world_size))
            return ranks, [[r] for r in ranks], {r: ("colocated", r, 0) for r in ranks}
        if n > 1 and self.node_local_problem() is None:
            t_n = self.num_targets // n
            d_n = L - t_n
            drafters = [(i % n) * L + i // n for i in range(d_n * n)]
            r_n = t_n // k
            replicas = [[(g % n) * L + d_n + (g // n) * k + m for m in range(k)] for g in range(r_n * n)]
        else:
            if n > 1 and not self.cross_node:
                raise TopologyError(f"the split of {self.num_targets} target ranks on {n} nodes of {L} ranks cannot "
                                    f"be node-local: {self.node_local_problem()}. Choose topology.target_ranks so "
                                    f"that every node gets the same number of target ranks (a multiple of "
                                    f"target.tensor_parallel={k}), or set topology.cross_node=true to let features "
                                    "cross nodes")
            d = self.world_size - self.num_targets
            drafters = list(range(d))
            replicas = [[d + g * k + m for m in range(k)] for g in range(self.num_targets // k)]
            for rep in replicas:
                if len({r // L for r in rep}) > 1:
                    raise TopologyError(f"target replica {rep} would span nodes (tensor parallelism stays within a "
                                        f"node of {L} ranks): choose topology.target_ranks so that the replicas of "
                                        f"{k} ranks align with the nodes")
        role = {r: ("drafter", i, 0) for i, r in enumerate(drafters)}
        for g, rep in enumerate(replicas):
            for m, r in enumerate(rep):
                role[r] = ("target", g, m)
        return drafters, replicas, role

    # ---- ranks ----
    @property
    def num_drafters(self) -> int:
        return self.world_size - self.num_targets

    @property
    def num_replicas(self) -> int:
        return self.world_size if self.colocated else self.num_targets // self.tp

    @property
    def drafter_ranks(self) -> list[int]:
        """Drafter ranks in index order (drafter i trains messages i, i+D, ...)."""
        return list(self._layout[0])

    @property
    def replicas(self) -> list[list[int]]:
        """The ranks of each replica, in replica order."""
        return [list(r) for r in self._layout[1]]

    @property
    def feeders(self) -> list[int]:
        """The rank of each replica that sends its features (its first), in replica order."""
        return [r[0] for r in self._layout[1]]

    @property
    def my_drafters(self) -> list[int]:
        """The drafter ranks this feeder streams to (and says END to): all of them, or itself when colocated."""
        return [self.rank] if self.colocated else self.drafter_ranks

    @property
    def my_feeders(self) -> list[int]:
        """The feeders that stream to this drafter (each says END): all of them, or itself when colocated."""
        return [self.rank] if self.colocated else self.feeders

    @property
    def target_ranks(self) -> list[int]:
        """Every target rank, sorted."""
        return sorted(r for rep in self._layout[1] for r in rep)

    @property
    def role(self) -> str:
        return self.role_of(self.rank)

    def role_of(self, rank: int) -> str:
        return self._layout[2][rank][0]

    @property
    def index(self) -> int:
        """Drafter index of a drafter rank; replica index of a target rank."""
        return self._layout[2][self.rank][1]

    @property
    def replica_rank(self) -> int:
        """Position of a target rank in its replica (0: the feeder)."""
        return self._layout[2][self.rank][2]

    @property
    def is_feeder(self) -> bool:
        return self.role in ("target", "colocated") and self.replica_rank == 0

    @property
    def my_replica(self) -> list[int]:
        return list(self._layout[1][self.index]) if self.role in ("target", "colocated") else []

    def replica_of(self, rank: int) -> int:
        """Replica index of a target rank."""
        return self._layout[2][rank][1]

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # ---- routing ----
    def target_for(self, j: int) -> int:
        """Global rank of the feeder that sends run-message j."""
        return self._layout[1][j % self.num_replicas][0]

    def drafter_for(self, j: int) -> int:
        """Global rank of the drafter that trains on run-message j."""
        return self._layout[0][j % self.num_drafters]

    def target_messages(self, num_messages: int, index: Optional[int] = None) -> range:
        """Run-message indices one replica runs (every rank of it), in the order it must send them."""
        i = self.index if index is None else index
        return range(i, num_messages, self.num_replicas)

    def drafter_messages(self, num_messages: int, index: Optional[int] = None) -> range:
        """Run-message indices one drafter receives, in order (step s trains message s*D + index)."""
        i = self.index if index is None else index
        return range(i, num_messages, self.num_drafters)

    def num_steps(self, num_messages: int) -> int:
        """Optimizer steps of every drafter: all take the same number (a drafter without a message in the
        last step joins with an empty batch so the data-parallel collectives line up)."""
        return -(-num_messages // self.num_drafters)

    def crosses_nodes(self, j: int) -> bool:
        return self.node_of(self.target_for(j)) != self.node_of(self.drafter_for(j))

    def describe(self) -> str:
        D, R, k = self.num_drafters, self.num_replicas, self.tp
        if self.colocated:
            return (f"{self.world_size} colocated rank(s): each captures its own messages and trains on them "
                    f"(message j on rank j%{D}, features never leave the rank); drafters data-parallel over "
                    f"{self.drafter_ranks}")
        head = (f"{self.world_size} ranks: drafters {self.drafter_ranks} (data-parallel"
                f"{' over all nodes' if self.nodes > 1 else ''}), targets {self.target_ranks} in {R} replica(s) of "
                f"{k} rank(s); message j: replica j%{R} -> drafter j%{D}; {self.nodes} node(s)")
        if self.nodes > 1:
            head += ("; node-local: every message stays on its node" if self.node_local
                     else "; NOT node-local (topology.cross_node=true): messages cross nodes")
        lines = [head]
        for n in range(self.nodes):
            reps = [(g, rep) for g, rep in enumerate(self._layout[1]) if self.node_of(rep[0]) == n]
            drs = [(i, r) for i, r in enumerate(self._layout[0]) if self.node_of(r) == n]
            feeds = []
            for g, rep in reps:
                to = sorted({self.drafter_for(j) for j in range(g, R * D, R)})
                feeds.append(f"replica {g} ranks {rep} (sends from {rep[0]}) -> drafter ranks {to}")
            lines.append(f"  node {n}: drafter ranks {[r for _, r in drs]}; " + ("; ".join(feeds) or "no targets"))
        return "\n".join(lines)


def nodes_from_env(world_size: int, rank: int) -> int:
    """Number of nodes of a torchrun job (WORLD_SIZE / LOCAL_WORLD_SIZE; 1 outside torchrun). The layout assumes
    torchrun's numbering: the ranks of node n are n*L .. n*L+L-1 (GROUP_RANK n), which is checked here."""
    import os
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if local <= 0 or world_size % local:
        raise TopologyError(f"LOCAL_WORLD_SIZE={local} does not divide WORLD_SIZE={world_size}: every node needs "
                            "the same number of ranks (torchrun --nproc-per-node)")
    group = os.environ.get("GROUP_RANK")
    if group is not None and int(group) != rank // local:
        raise TopologyError(f"rank {rank} is on node GROUP_RANK={group}, not {rank // local}: the ranks of a node "
                            "are not consecutive")
    return world_size // local


def make_topology(world_size: int, rank: int, target_ranks: int, tp: int = 1, cross_node: bool = False,
                  nodes: Optional[int] = None) -> Topology:
    return Topology(world_size, rank, target_ranks, tp=tp,
                    nodes=nodes_from_env(world_size, rank) if nodes is None else nodes, cross_node=cross_node)
