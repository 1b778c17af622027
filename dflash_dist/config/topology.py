"""``topology.*``: the split into target and drafter ranks, timeouts, transport and calibration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from dflash_dist.config.base import _require, _sub


@dataclass
class TopologyTuning:
    """Transport knobs; the defaults are the measured best."""

    rendezvous_sends: Optional[bool] = None
    """Post each payload send only after the drafter has posted the matching receive (a counter per link in the
    rendezvous store). An NCCL send posted earlier runs on the target GPU until the drafter takes it and slowed
    the target's capture 1.4-1.5x on an H200 (bench/experiments/send_overlap.py). None: on when the payloads go over
    NCCL, off over gloo (CPU: a waiting gloo send costs nothing, and the target could post a payload only between its
    synchronous CPU forwards). False: send at once."""


@dataclass
class TopologyConfig:
    target_ranks: Any = 1
    """How many ranks run the target (one node: the last T global ranks, W-T..W-1; several nodes: the same share of
    every node, see comm/topology.py); the rest train the drafter. A multiple of ``target.tensor_parallel``.
    ``0`` or ``colocated``: every rank holds both roles, capturing its own messages and training on them (features
    never leave the device; the drafters stay data-parallel over all ranks); a job of one process is always
    colocated. ``auto``: measure on this job's ranks (rank 0 times drafter steps, rank W-1 target batches) and take
    whichever of colocated and the T + D splits has the highest predicted samples/s (``dflash_dist.cli.plan``)."""

    plan: Optional[str] = None
    """With ``target_ranks=auto``: a dflash-plan plan.json. The job takes the split the plan chose for its world
    size instead of measuring, and logs the plan's predicted samples/s next to the samples/s it measures."""

    cross_node: bool = False
    """Multi-node jobs: let features cross nodes. False (default): every node runs the same split (its own target
    replicas and the drafters they feed) and a split that cannot be node-local is refused; True: a split that
    cannot be node-local runs with the single-node layout (drafters first), and most messages cross the network."""

    max_in_flight: int = 4
    """Messages a target may have sent but not yet seen received, per drafter link (backpressure)."""

    timeout_s: float = 60.0
    """A rank that waits this long on a peer after warm-up declares the job dead and exits non-zero."""

    warmup_timeout_s: float = 900.0
    """The same limit during model load and compilation (and for the calibration of ``target_ranks=auto``)."""

    plan_target_batches: int = 8
    """``target_ranks=auto`` and dflash-plan: target batches (the first messages of the plan) timed to measure
    target supply, after an untimed warm-up pass over them (steady state)."""

    plan_drafter_steps: int = 8
    """``target_ranks=auto`` and dflash-plan: drafter training steps (on the same first messages, random
    features) timed to measure drafter demand, after an untimed warm-up pass over them. dflash-plan on CPU
    rehearses each split instead: windows of this many steps of the real job, after one warm-up window."""

    plan_rounds: int = 5
    """``target_ranks=auto`` and dflash-plan: each side times its batches (steps) this many times over; its rate is
    the median round's, and the spread of the rounds (min..max) makes near-ties, which go to fewer targets.
    dflash-plan on CPU: the rehearsal's steady windows."""

    plan_min_seconds: float = 2.0
    """``target_ranks=auto`` and dflash-plan: more rounds (up to 10 x plan_rounds) until each side has timed at
    least this long (a few tenths of a second on a busy machine flip the choice between runs)."""

    tuning: TopologyTuning = field(default_factory=TopologyTuning)
    """Transport knobs (``topology.tuning.*``)."""

    def __post_init__(self) -> None:
        self.tuning = _sub(self.tuning, TopologyTuning, "topology.tuning")
        t = self.target_ranks
        if isinstance(t, str) and t.strip().isdigit():
            t = int(t)
        if isinstance(t, float) and t.is_integer():
            t = int(t)
        if t == "colocated":
            t = 0
        _require(t == "auto" or (isinstance(t, int) and not isinstance(t, bool) and t >= 0),
                 f"topology.target_ranks={self.target_ranks!r}: give a number of target ranks (0 or colocated: every "
                 f"rank holds both roles) or auto")
        self.target_ranks = t
        _require(self.plan is None or t == "auto", f"topology.plan={self.plan}: set topology.target_ranks=auto "
                 f"to take the split from the plan (or drop topology.plan)")
        _require(self.max_in_flight >= 1, "topology.max_in_flight must be >= 1")
        _require(self.timeout_s > 0 and self.warmup_timeout_s > 0, "topology timeouts must be > 0")
        _require(self.plan_target_batches >= 1, "topology.plan_target_batches must be >= 1")
        _require(self.plan_drafter_steps >= 1, "topology.plan_drafter_steps must be >= 1")
        _require(self.plan_rounds >= 1, "topology.plan_rounds must be >= 1")
        _require(self.plan_min_seconds >= 0, "topology.plan_min_seconds must be >= 0")
