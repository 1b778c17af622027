"""``topology.target_ranks=auto`` at startup: rank 0 measures the drafter (data-parallel with every rank that
measures no target, as the job's drafters train) and rank W-1 the target (with its replica's other ranks) at the
same time, the results meet in the rendezvous store (keys ``dflash/plan/*``), rank 0 picks the split and publishes
it."""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from dflash_dist.planning.measure import measure_drafter_demand, measure_target_supply
from dflash_dist.planning.record import plan_record
from dflash_dist.planning.split import choose_split, format_rates, format_splits, measured_range

if TYPE_CHECKING:
    import torch

log = logging.getLogger("dflash_dist")

KEY_PREFIX = "dflash/plan/"


def _report(store, name: str, fn) -> dict:
    """Run a measurement and post its result (or its error, so the reader fails now instead of at a timeout)."""
    try:
        value = fn()
    except BaseException as e:
        store.set(KEY_PREFIX + name, json.dumps({"error": f"{type(e).__name__}: {e}"}))
        raise
    store.set(KEY_PREFIX + name, json.dumps(value))
    return value


def wait_for(store, name: str, rank: int, what: str, timeout_s: float) -> dict:
    """The value rank ``rank`` posted under ``dflash/plan/<name>``; a clear error naming that rank if it posted
    an error or nothing within ``timeout_s``."""
    try:
        store.wait([KEY_PREFIX + name], timedelta(seconds=timeout_s))
    except Exception as e:  # the store's timeout (DistStoreError) or a lost store
        raise RuntimeError(f"topology.target_ranks=auto: rank {rank} did not report {what} within {timeout_s:.0f} s "
                           f"(topology.warmup_timeout_s): {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                           ) from e
    value = json.loads(store.get(KEY_PREFIX + name))
    if "error" in value:
        raise RuntimeError(f"topology.target_ranks=auto: rank {rank} failed while measuring {what}: {value['error']}")
    return value


def write_plan_json(path: str, res: dict) -> None:
    from dflash_dist.storage import writing
    tmp = path + ".tmp"
    with writing(path, "the split plan"):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, path)


def split_from_plan_file(path: str, world: int) -> dict:
    """``topology.plan=plan.json``: the split dflash-plan chose for a world of ``world`` ranks (read on every rank,
    the same file), with the plan's measured rates; a ConfigError naming the key when it has none, or when a value
    the job would use is of the wrong type or outside what ``world`` ranks allow (``check_plan_split``)."""
    from dflash_dist.checkpoint.safe_io import CheckpointError, read_json
    from dflash_dist.config import ConfigError
    try:
        plan = read_json(os.path.dirname(os.path.abspath(path)), os.path.basename(path))
    except CheckpointError as e:
        raise ConfigError(f"topology.plan={path}: cannot read a plan.json: {e}") from None
    splits = plan.get("splits")
    if not isinstance(splits, list) or not all(isinstance(s, dict) for s in splits):
        raise ConfigError(f"topology.plan={path}: 'splits' is not a list of objects; write the plan with dflash-plan")
    found = [s for s in splits if is_int(s.get("world_size")) and s.get("world_size") == world]
    if not found:
        sizes = [s.get("world_size") for s in splits]
        raise ConfigError(f"topology.plan={path}: no split for {world} ranks (the plan has {sizes}); run "
                          f"dflash-plan --gpus {world}")
    check_plan_split(path, found[0], world)
    res = dict(found[0], source=f"topology.plan={path}", measured=True)
    for side in ("supply", "demand"):
        if side in plan:
            m = plan[side]
            if not isinstance(m, dict) or not all(isinstance(m.get(k), (int, float)) and not isinstance(m.get(k), bool)
                                                  for k in ("samples_per_s", "tokens_per_s")):
                raise ConfigError(f"topology.plan={path}: {side}={str(m)[:100]}: an object with the measured "
                                  f"samples_per_s and tokens_per_s (numbers); write the plan with dflash-plan")
            res[side] = m
    log.info("topology.plan=%s: %d target + %d drafter ranks (0 targets: colocated), planned %.4g samples/s", path, res["target_ranks"],
             res["drafter_ranks"], res["predicted_samples_per_s"])
    return res


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_plan_split(path: str, split: dict, world: int) -> None:
    """The fields of a plan's split the job uses, typed and against the world size: ``target_ranks`` a whole
    number in [0, world) (0: colocated), ``drafter_ranks`` the rest (all ``world`` when colocated), the predicted
    rate a positive number, each row a split of ``world`` ranks. A ConfigError naming the field and what is
    allowed."""
    from dflash_dist.config import ConfigError

    def bad(field: str, allowed: str) -> ConfigError:
        return ConfigError(f"topology.plan={path}: splits[world_size={world}].{field}={split.get(field)!r}: "
                           f"{allowed}; write the plan with dflash-plan --gpus {world}")
    t, d = split.get("target_ranks"), split.get("drafter_ranks")
    if not is_int(t) or not 0 <= t < world:
        raise bad("target_ranks", f"a whole number from 0 (colocated) to {world - 1}")
    if not is_int(d) or d != (world - t if t else world):
        raise bad("drafter_ranks", f"{world - t if t else world} (the {world} ranks less its {t} target ranks)")
    rate = split.get("predicted_samples_per_s")
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not rate > 0:
        raise bad("predicted_samples_per_s", "a positive number")
    if not isinstance(split.get("bottleneck"), str):
        raise bad("bottleneck", "a name (target, drafter, both, colocated)")
    rows = split.get("rows")
    if not isinstance(rows, list) or not all(
            isinstance(r, dict) and is_int(r.get("targets")) and is_int(r.get("drafters"))
            and 0 <= r["targets"] < world and isinstance(r.get("samples_per_s"), (int, float))
            and not isinstance(r.get("samples_per_s"), bool) and isinstance(r.get("bottleneck"), str) for r in rows):
        raise bad("rows", "a list of {targets, drafters, samples_per_s, bottleneck} rows of this world size")


def split_for_job(job, rank: int, world: int, device: torch.device) -> int:
    """``topology.target_ranks=auto``: sets ``job.auto_split`` (from a dflash-plan plan.json, ``topology.plan``, or
    measured now) and ``job.plan_record``, its ``kind: plan`` metrics record, built once here for the drafter loop to
    log; returns the number of target ranks."""
    job.auto_split = (split_from_plan_file(job.cfg.topology.plan, world) if job.cfg.topology.plan
                      else auto_split(job, rank, world, device))
    job.plan_record = plan_record(job.auto_split)
    return int(job.auto_split["target_ranks"])


def auto_split(job, rank: int, world: int, device: torch.device) -> dict:
    """``topology.target_ranks=auto`` on every rank of the job (after the data plan, before the role groups):
    returns the same dict on every rank (``target_ranks`` is the split); rank 0 logs it and writes plan.json."""
    timeout = job.cfg.topology.warmup_timeout_s
    import torch.distributed as dist
    store = dist.distributed_c10d._get_default_store()
    t0 = time.monotonic()
    k = job.cfg.target.tensor_parallel
    # target.tensor_parallel=k: the last k ranks measure as one replica (a group every rank creates, members or not)
    members = list(range(world - k, world))
    group = build = None  # one target rank: its own model, nothing to agree on
    if k > 1:
        from dflash_dist.targets.hf import build_target_replica, random_target_dir
        if world <= k:
            from dflash_dist.config import ConfigError
            raise ConfigError(f"topology.target_ranks=auto: a replica of {k} ranks leaves no drafter in a world of "
                              f"{world}")
        group = dist.new_group(ranks=members, timeout=timedelta(seconds=timeout))
        rdir = os.path.join(random_target_dir(job.run_dir, 0), "plan")

        def build():
            return build_target_replica(job.cfg.target, device.type, group, rdir, build_random=rank == members[0],
                                        ready=(lambda: store.set(KEY_PREFIX + "random_target", "1"),
                                               lambda: store.wait([KEY_PREFIX + "random_target"],
                                                                  timedelta(seconds=timeout))))
        if rank in members[:-1]:
            log.info("topology.target_ranks=auto: measuring the supply of replica %s with rank %d", members,
                     world - 1)
            measure_target_supply(job, device, build=build, group=group)
    # the drafter side: rank 0 and every rank that measures no target, data-parallel as the job's drafters are
    # (the gradient all-reduce is in the measured step; on CPU the ranks also load the machine as the job does)
    drafters = [r for r in range(world) if r != world - 1 and r not in members]
    dgroup = dist.new_group(ranks=drafters, timeout=timedelta(seconds=timeout)) if len(drafters) > 1 else None
    if rank == world - 1:  # a target in every split
        log.info("topology.target_ranks=auto: measuring target supply on this rank%s",
                 f" (replica {members} of target.tensor_parallel={k})" if k > 1 else "")
        _report(store, "supply", lambda: measure_target_supply(job, device, build=build, group=group))
    elif rank != 0 and rank in drafters:
        log.info("topology.target_ranks=auto: drafter steps on this rank, data-parallel with rank 0's measurement "
                 "(ranks %s)", drafters)
        measure_drafter_demand(job, device, group=dgroup)
    if rank != 0:
        # rank 0 waits up to `timeout` for rank W-1 after its own measurement: give it time to say why
        return wait_for(store, "choice", 0, "the chosen split", 2 * timeout)
    try:  # rank 0: a drafter in every split
        log.info("topology.target_ranks=auto: measuring drafter demand on this rank, data-parallel over ranks %s "
                 "(rank %d measures the target)", drafters, world - 1)
        demand = measure_drafter_demand(job, device, group=dgroup)
        supply = wait_for(store, "supply", world - 1, "its target supply", timeout)
        if k > 1:  # the replica's rate (and its measured spread), per rank of it, for splits of whole replicas
            per_rank = {key: supply[key] / k for key in ("samples_per_s", "tokens_per_s", "samples_per_s_min",
                                                         "samples_per_s_max") if key in supply}
            supply.update(replica_samples_per_s=supply["samples_per_s"], tensor_parallel=k, **per_rank)
        res = choose_split(world, supply["samples_per_s"], demand["samples_per_s"], measured_range(supply),
                           measured_range(demand), tensor_parallel=k)
        res.update(measured=True, measured_on={"drafter": 0, "target": world - 1}, supply=supply, demand=demand,
                   calibration_s=time.monotonic() - t0)
    except BaseException as e:
        store.set(KEY_PREFIX + "choice", json.dumps({"error": f"rank 0: {type(e).__name__}: {e}"}))
        raise
    store.set(KEY_PREFIX + "choice", json.dumps(res))
    log.info("topology.target_ranks=auto: measured in %.1f s (drafter demand on rank 0, target supply on rank %d)\n"
             "%s\n%s", res["calibration_s"], world - 1, format_rates(supply, demand), format_splits(res))
    write_plan_json(os.path.join(job.run_dir, "plan.json"), res)
    return res
