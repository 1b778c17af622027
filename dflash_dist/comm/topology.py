"""Roles and routing.

Global ranks 0..D-1 train the drafter (rank 0 leads: logging, checkpoints), ranks D..W-1 run the target.
Message j of a run (plan index k = start + j) goes from target ``j mod T`` to drafter ``j mod D``. Every
rank handles its messages in increasing j, so the smallest pending j always has both ends ready: no
deadlock for any T:D, and every drafter gets every D-th message, so none idles while another has work.
The plan itself never depends on T or D, which is what lets a run resume with another split.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    world_size: int
    rank: int
    num_targets: int

    def __post_init__(self) -> None:
        if not 1 <= self.num_targets < self.world_size:
            raise ValueError(f"need 1 <= targets < world size, got {self.num_targets} targets of {self.world_size}")

    @property
    def num_drafters(self) -> int:
        return self.world_size - self.num_targets

    @property
    def drafter_ranks(self) -> list[int]:
        return list(range(self.num_drafters))

    @property
    def target_ranks(self) -> list[int]:
        return list(range(self.num_drafters, self.world_size))

    @property
    def role(self) -> str:
        return "drafter" if self.rank < self.num_drafters else "target"

    @property
    def index(self) -> int:
        """Index of this rank among the ranks of its role."""
        return self.rank if self.role == "drafter" else self.rank - self.num_drafters

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def role_of(self, rank: int) -> str:
        return "drafter" if rank < self.num_drafters else "target"

    def target_for(self, j: int) -> int:
        """Global rank of the target that produces run-message j."""
        return self.num_drafters + j % self.num_targets

    def drafter_for(self, j: int) -> int:
        """Global rank of the drafter that trains on run-message j."""
        return j % self.num_drafters

    def target_messages(self, num_messages: int, index: int | None = None) -> range:
        """Run-message indices one target produces, in the order it must send them."""
        i = self.index if index is None else index
        return range(i, num_messages, self.num_targets)

    def drafter_messages(self, num_messages: int, index: int | None = None) -> range:
        """Run-message indices one drafter receives, in order (step s trains message s*D + index)."""
        i = self.index if index is None else index
        return range(i, num_messages, self.num_drafters)

    def num_steps(self, num_messages: int) -> int:
        """Optimizer steps of every drafter: all take the same number (a drafter without a message in the
        last step joins with an empty batch so the data-parallel collectives line up)."""
        return -(-num_messages // self.num_drafters)

    def describe(self) -> str:
        return (f"{self.world_size} ranks: drafters {self.drafter_ranks} (data-parallel), "
                f"targets {self.target_ranks}; message j: target {self.num_drafters}+j%{self.num_targets} "
                f"-> drafter j%{self.num_drafters}")
