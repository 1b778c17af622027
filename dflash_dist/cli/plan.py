"""Choosing the target/drafter split from measured rates: ``topology.target_ranks=auto`` and ``dflash-plan``.

A job of W ranks with T targets runs at min(T * supply, (W - T) * demand) samples/s: supply = samples/s one
target rank produces, demand = samples/s one drafter rank trains (the slower side sets the pace; transport is
assumed hidden behind compute, which bench/pipeline.py checks). Both rates are measured with the project's
own code on the job's own data: the target role's model and ``FeatureCapture`` on real batches of the plan,
and ``DrafterTrainer``'s step (alone: no DDP) on the same messages with random features.

* ``topology.target_ranks=auto`` (``train.setup``): rank 0 is a drafter and rank W-1 a target for every
  split, so both measure at the same time on their own devices, without spending a rank on a role it will
  not have; the other ranks wait. The results meet in the rendezvous store (keys ``dflash/plan/*``), rank 0
  picks the split and publishes it, and every rank then builds its role groups. W = 2 has one split (1 + 1)
  and measures nothing.
* ``dflash-plan [--gpus 2,4,8] [--out plan.json] [hydra overrides]``: one process, both measurements one
  after the other on one device, the best split for each W.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # annotations only: the split arithmetic (bench/plan_split.py) runs without torch
    pass


log = logging.getLogger("dflash_dist")


from dflash_dist.autosplit import (
    choose_split,
    format_rates,
    measure_drafter_demand,
    measure_target_supply,
    write_plan_json,
)
from dflash_dist.paths import CONF_DIR


def compose_config(overrides: list[str]):
    """The JobConfig ``python -m dflash_dist.train <overrides>`` would run (as dflash-doctor composes it)."""
    from dflash_dist.config import JobConfig
    from dflash_dist.config import compose_config as compose
    return JobConfig.from_omegaconf(compose(overrides, CONF_DIR))


def plan_offline(cfg, world_sizes: list[int]) -> dict:
    """dflash-plan: the job's data plan (as train.setup builds it), both measurements on one device, one after
    the other, and the best split for each world size."""
    import torch

    from dflash_dist.config import resolve_device
    from dflash_dist.job import build_job
    device_type = resolve_device(cfg)
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    job = build_job(cfg, rank=0, world_size=None, ctrl=None, device_type=device_type)
    log.info("measuring target supply (%d batches of the plan) on %s", cfg.topology.plan_target_batches, device)
    supply = measure_target_supply(job, device)
    log.info("measuring drafter demand (%d steps) on %s", cfg.topology.plan_drafter_steps, device)
    demand = measure_drafter_demand(job, device)
    splits = [choose_split(w, supply["samples_per_s"], demand["samples_per_s"]) for w in world_sizes]
    return {"tool": "dflash-plan", "device": str(device), "supply": supply, "demand": demand, "splits": splits,
            "best": [{"world_size": s["world_size"], "target_ranks": s["target_ranks"],
                      "drafter_ranks": s["drafter_ranks"], "predicted_samples_per_s": s["predicted_samples_per_s"],
                      "per_gpu": s["best"]["per_gpu"], "target_util": s["best"]["target_util"],
                      "drafter_util": s["best"]["drafter_util"], "bottleneck": s["bottleneck"]} for s in splits]}


def format_best(res: dict) -> str:
    # target load < 100%: that share of the target GPUs would idle (the split is whole ranks)
    lines = [f"{'GPUs':>4}  {'targets':>7}  {'drafters':>8}  {'samples/s':>10}  {'samples/s/GPU':>13}  "
             f"{'target load':>11}  bound by"]
    for b in res["best"]:
        lines.append(f"{b['world_size']:>4}  {b['target_ranks']:>7}  {b['drafter_ranks']:>8}  "
                     f"{b['predicted_samples_per_s']:>10.4g}  {b['per_gpu']:>13.4g}  {100 * b['target_util']:>10.0f}%  "
                     f"{b['bottleneck']}")
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
    else:
        ws = list(range(2, 9))
    if not ws or min(ws) < 2:
        raise ValueError(f"--gpus {arg!r}: every world size must be >= 2 (one target and one drafter rank)")
    return sorted(set(ws))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="dflash-plan", description="Measure target supply and drafter demand on one "
                                 "device and print the best target/drafter split for each GPU count.")
    ap.add_argument("--gpus", default=None, help="comma list of world sizes (default: the visible GPU count, or "
                                                 "2..8 without 2 GPUs)")
    ap.add_argument("--out", default="plan.json", help="JSON output (default plan.json)")
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
            cfg = compose_config(args.overrides)
        except ConfigError:
            raise
        except Exception as e:  # --gpus, or Hydra: unknown group or key, unparsable override
            raise ConfigError(f"{type(e).__name__}: {e}") from e
        res = plan_offline(cfg, world_sizes)
    except ConfigError as e:
        print(f"dflash-plan: configuration error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        import traceback
        traceback.print_exc()  # an unexpected failure: where it happened matters more than a short line
        print(f"dflash-plan: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    res["overrides"] = list(args.overrides)
    print("\nmeasured (one device, one process):")
    print(format_rates(res["supply"], res["demand"]))
    print(f"\nbest split per GPU count (job samples/s = min(T x supply, (W - T) x demand)):\n{format_best(res)}")
    write_plan_json(args.out, res)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
