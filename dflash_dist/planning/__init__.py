"""Choosing the target/drafter split from measured rates: ``topology.target_ranks=auto`` and ``dflash-plan``.

A job of W ranks with T targets runs at min(T * supply, (W - T) * demand) samples/s, and colocated (T = 0, every
rank both roles in turn) at W / (1/supply + 1/demand): supply = samples/s one
target rank produces, demand = samples/s one drafter rank trains (the slower side sets the pace; transport is
assumed hidden behind compute, which bench/pipeline.py checks). Both rates are measured with the project's
own code on the job's own data: the target role's model and ``FeatureCapture`` on real batches of the plan,
and ``DrafterTrainer``'s step (alone: no DDP) on the same messages with random features.

* ``topology.target_ranks=auto`` (``job.setup``; ``planning/startup.py``): rank 0 is a drafter and rank W-1 a target for every
  split, so both measure at the same time on their own devices, without spending a rank on a role it will
  not have; the other ranks wait (on CPU they train drafter steps meanwhile: the ranks share the cores). The results meet in the rendezvous store (keys ``dflash/plan/*``), rank 0
  picks the split and publishes it, and every rank then builds its role groups. One process is colocated and
  measures nothing.
* ``dflash-plan [--gpus 2,4,8] [--out plan.json] [hydra overrides]``: one process, both measurements one
  after the other on one device, the best split for each W. On CPU (where a job's ranks share the cores) each
  split is rehearsed as a short real job instead (``planning/rehearse.py``); ``topology.plan=plan.json`` starts a
  job from the plan, which then logs planned vs measured samples/s (``telemetry/plan_check.py``).

Each side times its batches (steps) ``topology.plan_rounds`` times over, and more rounds until it has timed
``topology.plan_min_seconds``; its rate is the median round's and the rounds' min..max is its spread. The
choice: the fastest split by the median rates, unless a split with fewer targets is a near-tie, i.e. its
predicted rate reaches the fastest split's lowest one (both sides at their slowest round): within the
measurement's noise, the fewest targets win (the drafters are the ranks that train). Exact ties are near-ties.

Split arithmetic (torch-free): ``planning/split.py``; the measurements: ``planning/measure.py``; the startup
rendezvous: ``planning/startup.py``; the ``kind: plan`` record: ``planning/record.py``; the scaling model on paper
(docs/scaling.md): ``planning/scaling.py``; each rank's memory plan: ``planning/memory.py`` (the drafter's DDP or
FSDP2 training state: ``planning/training_state.py``), against the limits ``planning/limits.py`` reads (a GPU's
memory, the CPU machine's available memory, ``ulimit -v``).
"""
