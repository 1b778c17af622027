"""``dflash-plan [--gpus 2,4,8] [--out plan.json] [hydra overrides]``: the job's data plan, target supply and
drafter demand measured one after the other on one device (``dflash_dist.planning``), and the best split for each world
size; ``--replica-supply`` plans target replicas from a replica's rate measured elsewhere. On CPU the ranks share
the machine, so each split is rehearsed as a short real job instead (``planning/rehearse.py``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # annotations only: the split arithmetic (bench/plan_split.py) runs without torch
    pass


log = logging.getLogger("dflash_dist")


from dflash_dist.paths import CONF_DIR
from dflash_dist.planning.measure import measure_drafter_demand, measure_target_supply
from dflash_dist.planning.rehearse import rehearsal_steps, rehearse, split_from_rehearsals
from dflash_dist.planning.split import choose_split, format_rates, format_splits, measured_range, split_name
from dflash_dist.planning.startup import write_plan_json


def compose_config(overrides: list[str]):
    """The JobConfig ``python -m dflash_dist.train <overrides>`` would run (as dflash-doctor composes it)."""
    from dflash_dist.config import JobConfig
    from dflash_dist.config import compose_config as compose
    return JobConfig.from_omegaconf(compose(overrides, CONF_DIR))


def best_rows(splits: list[dict]) -> list[dict]:
    return [{"world_size": s["world_size"], "target_ranks": s["target_ranks"], "drafter_ranks": s["drafter_ranks"],
             "predicted_samples_per_s": s["predicted_samples_per_s"], "per_gpu": s["best"]["per_gpu"],
             "target_util": s["best"]["target_util"], "drafter_util": s["best"]["drafter_util"],
             "bottleneck": s["bottleneck"], "near_tie": s["near_tie"], "fastest_targets": s["fastest_targets"]}
            for s in splits]


def plan_rehearsed(cfg, job, world_sizes: list[int], overrides: list[str], targets: Optional[int]) -> dict:
    """dflash-plan on CPU: every split (or only those of ``targets`` target ranks) of each world size rehearsed as
    a short real job on this machine (planning/rehearse.py), the best by its measured median rate."""
    cache = cfg.data.cache_dir or os.path.join(job.run_dir, "data_cache")  # tokenized by build_job: shared
    window, warmup, steps = rehearsal_steps(cfg.topology)
    splits = []
    for w in world_sizes:
        runs = []
        for t in ([targets] if targets is not None else range(0, w)):
            log.info("rehearsing %s: %d steps, windows of %d after %d warm-up", split_name(t, w - t), steps, window,
                     warmup)
            runs.append(rehearse(cfg, overrides, w, t, cache, cfg.topology.warmup_timeout_s))
        splits.append(split_from_rehearsals(w, runs))
    return {"tool": "dflash-plan", "device": "cpu", "mode": "rehearsal", "splits": splits,
            "best": best_rows(splits)}


def plan_offline(cfg, world_sizes: list[int], replica_supply: Optional[float] = None,
                 overrides: Optional[list[str]] = None, targets: Optional[int] = None, alone: bool = False) -> dict:
    """dflash-plan: the job's data plan (as job.setup builds it), both measurements on one device, one after
    the other, and the best split for each world size; on CPU, rehearsals (``plan_rehearsed``)."""
    import torch

    from dflash_dist.config import resolve_device
    from dflash_dist.job import build_job
    device_type = resolve_device(cfg)
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    job = build_job(cfg, rank=0, world_size=None, ctrl=None, device_type=device_type)
    k = cfg.target.tensor_parallel
    if device_type == "cpu" and k == 1 and replica_supply is None and not alone:
        return plan_rehearsed(cfg, job, world_sizes, list(overrides or []), targets)
    if replica_supply is not None:  # measured elsewhere (a replica of k > 1 ranks needs k processes)
        supply = {"samples_per_s": replica_supply / k, "replica_samples_per_s": replica_supply,
                  "tensor_parallel": k, "measured": False, "source": "--replica-supply"}
    elif k > 1:
        from dflash_dist.config import ConfigError
        raise ConfigError(f"target.tensor_parallel={k}: one process cannot measure a replica of {k} ranks; measure "
                          f"its supply in a job with that replica (the metrics' target<r>_samples_per_s of its "
                          f"sending rank) and pass it as --replica-supply SAMPLES_PER_S")
    else:
        log.info("measuring target supply (%d batches of the plan) on %s", cfg.topology.plan_target_batches, device)
        supply = measure_target_supply(job, device)
    log.info("measuring drafter demand (%d steps) on %s", cfg.topology.plan_drafter_steps, device)
    demand = measure_drafter_demand(job, device)
    splits = [choose_split(w, supply["samples_per_s"], demand["samples_per_s"], measured_range(supply),
                           measured_range(demand), tensor_parallel=k) for w in world_sizes if w > k or k == 1]
    return {"tool": "dflash-plan", "device": str(device), "supply": supply, "demand": demand, "splits": splits,
            "best": best_rows(splits)}


def format_best(res: dict) -> str:
    # target load < 100%: that share of the target GPUs would idle (the split is whole ranks)
    lines = [f"{'GPUs':>4}  {'targets':>7}  {'drafters':>8}  {'samples/s':>10}  {'samples/s/GPU':>13}  "
             f"{'target load':>11}  bound by   (0 targets: colocated)"]
    for b in res["best"]:
        lines.append(f"{b['world_size']:>4}  {b['target_ranks']:>7}  {b['drafter_ranks']:>8}  "
                     f"{b['predicted_samples_per_s']:>10.4g}  {b['per_gpu']:>13.4g}  {100 * b['target_util']:>10.0f}%  "
                     f"{b['bottleneck']}" + (f" (near-tie: {b['fastest_targets']} targets fastest by the medians, "
                                             f"within the spread)" if b.get("near_tie") else ""))
    return "\n".join(lines)


def _world_sizes(arg: Optional[str]) -> list[int]:
    import torch
    if arg:
        try:
            ws = [int(x) for x in arg.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--gpus {arg!r}: give a comma list of integers, e.g. 2,4,8") from None
    elif torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        ws = [torch.cuda.device_count()]
    elif torch.cuda.is_available():
        ws = list(range(1, 9))
    else:  # CPU: each split is a rehearsal job of its own
        ws = [2, 3]
    if not ws or min(ws) < 1:
        raise ValueError(f"--gpus {arg!r}: every world size must be >= 1")
    return sorted(set(ws))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="dflash-plan", description="Measure target supply and drafter demand on one "
                                 "device and print the best target/drafter split for each GPU count.")
    ap.add_argument("--gpus", default=None, help="comma list of world sizes (default: the visible GPU count, or "
                                                 "2..8 without 2 GPUs; 2,3 on CPU)")
    ap.add_argument("--out", default="plan.json", help="JSON output (default plan.json)")
    ap.add_argument("--replica-supply", type=float, default=None,
                    help="samples/s of one target replica, measured elsewhere (required with "
                         "target.tensor_parallel > 1: one process cannot run a multi-rank replica); splits are then "
                         "whole replicas")
    ap.add_argument("--targets", type=int, default=None,
                    help="CPU: rehearse only the splits with this many target ranks, 0 for colocated (default: every "
                         "split)")
    ap.add_argument("--alone", action="store_true",
                    help="CPU: time each role alone in this process, one after the other (as on GPUs), instead of "
                         "rehearsing the splits; quick, but the job's ranks share the CPU and run slower")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for dflash-train (e.g. target=qwen3_8b_random)")
    args = ap.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s dflash-plan %(levelname)s %(message)s",
                        datefmt="%H:%M:%S", force=True)
    for noisy in ("httpx", "urllib3", "filelock", "torch._inductor", "torch._dynamo"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from dflash_dist.config import ConfigError
    try:
        try:
            world_sizes = _world_sizes(args.gpus)
            bad = [w for w in world_sizes if args.targets is not None and not 0 <= args.targets < w]
            if bad:
                raise ValueError(f"--targets {args.targets}: a split of {bad[0]} ranks has 0 (colocated) .. "
                                 f"{bad[0] - 1} targets")
            cfg = compose_config(args.overrides)
        except ConfigError:
            raise
        except Exception as e:  # --gpus, or Hydra: unknown group or key, unparsable override
            raise ConfigError(f"{type(e).__name__}: {e}") from e
        res = plan_offline(cfg, world_sizes, args.replica_supply, args.overrides, args.targets, args.alone)
    except ConfigError as e:
        print(f"dflash-plan: configuration error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        import traceback
        traceback.print_exc()  # an unexpected failure: where it happened matters more than a short line
        print(f"dflash-plan: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    res["overrides"] = list(args.overrides)
    if res.get("mode") == "rehearsal":
        for split in res["splits"]:
            print(f"\n{split['world_size']} ranks, each split rehearsed as a job on this machine (median window "
                  f"samples/s; supply / demand: each side's measured capacity):\n{format_splits(split)}")
    else:
        print("\nmeasured (one device, one process):")
        print(format_rates(res["supply"], res["demand"]))
    how = ("the rehearsed job's median samples/s" if res.get("mode") == "rehearsal"
           else "job samples/s = min(T x supply, (W - T) x demand)")
    print(f"\nbest split per GPU count ({how}):\n{format_best(res)}")
    print(f"start the job from it with: topology.target_ranks=auto topology.plan={args.out}")
    write_plan_json(args.out, res)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
