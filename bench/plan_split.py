#!/usr/bin/env python3
"""Projection: the best target/drafter split of W GPUs from measured per-GPU supply and demand.

supply = samples/s one target GPU produces (bench/target_capture.py, the capture row of ``--target-variant``, default
packed, the SpecForge-like ~550-token mix; samples/s = capture tokens/s / mean sample length), demand = samples/s
one drafter GPU trains (bench/drafter_step.py at ctx 550 / 256 anchors, flex backend). For every split T + D = W
the job runs at min(T * supply, D * demand) samples/s (the slower side sets the pace; transport assumed hidden, which
bench/pipeline.py checks; the arithmetic is ``dflash_dist.planning.split.choose_split``, shared with
``topology.target_ranks=auto`` and ``dflash-plan``, which measure both rates on the job's own data). Prints the
table, the best split and samples/s per GPU, writes JSON and, when matplotlib is importable, a PNG of supply vs
demand per split.

    python bench/plan_split.py --target-json target_capture.json --drafter-json drafter_step.json --out plan.json --png plan.png
    python bench/plan_split.py --supply 40 --demand 6 --gpus 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (puts the repo root on sys.path)

from dflash_dist.planning.split import choose_split  # noqa: E402  (torch-free)


def supply_from(path: str, mix: str, budget, variant: str = "packed") -> tuple[float, dict]:
    with open(path) as f:
        d = json.load(f)
    rows = [r for r in d.get("rows", []) if "error" not in r and r.get("capture_samples_per_s")]
    rows = [r for r in rows if r.get("variant", "padded") == variant] or rows  # JSON without that variant: any
    cand = [r for r in rows if str(r.get("mix")) == str(mix)] or rows
    if budget is not None:
        cand = [r for r in cand if int(r.get("budget", -1)) == int(budget)] or cand
    if not cand:
        raise SystemExit(f"{path}: no usable capture row")
    r = max(cand, key=lambda r: r["capture_samples_per_s"]) if budget is None else cand[0]
    return float(r["capture_samples_per_s"]), {"path": path, "mix": r.get("mix"), "budget": r.get("budget"),
                                                 "variant": r.get("variant", "padded"),
                                                 "tokens_per_s": r.get("capture_tokens_per_s"),
                                                 "mean_sample_len": r.get("mean_sample_len"),
                                                 "target": d.get("target"), "gpu": d.get("env", {}).get("gpu")}


def demand_from(path: str, config: str, backend: str, batch: int) -> tuple[float, dict]:
    with open(path) as f:
        d = json.load(f)
    ctx, anchors = (int(x) for x in config.split("x"))
    rows = [r for r in d.get("rows", []) if "error" not in r and r.get("mode") == "train"
            and r.get("ctx") == ctx and r.get("anchors") == anchors and r.get("batch") == batch]
    pick = [r for r in rows if r.get("backend") == backend] or rows
    if not pick:
        raise SystemExit(f"{path}: no training row for ctx={ctx} anchors={anchors} b={batch}")
    r = pick[0]
    return float(r["samples_per_s"]), {"path": path, "ctx": ctx, "anchors": anchors, "batch": batch,
                                        "backend": r.get("backend"), "ms_per_step": r.get("ms_per_step"),
                                        "mfu_measured_peak": r.get("mfu_measured_peak"),
                                        "gpu": d.get("env", {}).get("gpu")}


def project(supply: float, demand: float, gpus: int) -> dict:
    """Every split of ``gpus`` and the best one: ``dflash_dist.planning.split.choose_split`` (the arithmetic that
    ``topology.target_ranks=auto`` and dflash-plan use)."""
    return choose_split(gpus, supply, demand)


def plot(res: dict, path: str, supply: float, demand: float, gpus: int) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # matplotlib is optional
        return f"no plot: {C.short_error(e)}"
    ts = [r["targets"] for r in res["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(ts, [r["supply"] for r in res["rows"]], "o-", label=f"target supply T x {supply:.2f}")
    ax.plot(ts, [r["demand"] for r in res["rows"]], "s-", label=f"drafter demand (W-T) x {demand:.2f}")
    ax.bar(ts, [r["samples_per_s"] for r in res["rows"]], alpha=0.25, color="gray", label="job = min")
    b = res["best"]
    ax.annotate(f"best {b['targets']}T+{b['drafters']}D\n{b['samples_per_s']:.1f} samples/s",
                (b["targets"], b["samples_per_s"]), textcoords="offset points", xytext=(10, 10))
    ax.set_xlabel(f"target GPUs T (of W={gpus})")
    ax.set_ylabel("samples/s")
    ax.set_title("dflash_dist split projection")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target-json", default=None)
    p.add_argument("--drafter-json", default=None)
    p.add_argument("--supply", type=float, default=None, help="samples/s per target GPU (overrides --target-json)")
    p.add_argument("--demand", type=float, default=None, help="samples/s per drafter GPU (overrides --drafter-json)")
    p.add_argument("--target-mix", default="550")
    p.add_argument("--target-budget", type=int, default=16384)
    p.add_argument("--target-variant", default="packed",
                   help="target_capture row variant (packed: what target.packing=auto runs on CUDA; falls back to "
                        "whatever the JSON has)")
    p.add_argument("--drafter-config", default="550x256", help="CTXxANCHORS row of drafter_step")
    p.add_argument("--drafter-backend", default="flex")
    p.add_argument("--drafter-batch", type=int, default=1)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--out", default=None)
    p.add_argument("--png", default=None)
    args = p.parse_args(argv)
    src: dict = {}
    supply, demand = args.supply, args.demand
    if supply is None:
        if not args.target_json:
            p.error("give --supply or --target-json")
        supply, src["supply"] = supply_from(args.target_json, args.target_mix, args.target_budget,
                                            args.target_variant)
    if demand is None:
        if not args.drafter_json:
            p.error("give --demand or --drafter-json")
        demand, src["demand"] = demand_from(args.drafter_json, args.drafter_config, args.drafter_backend,
                                            args.drafter_batch)
    if args.gpus < 2 or supply <= 0 or demand <= 0:
        p.error("need --gpus >= 2 and positive supply and demand")
    res = project(supply, demand, args.gpus)
    out = {"bench": "plan_split", "gpus": args.gpus, "supply_per_target_gpu": supply,
           "demand_per_drafter_gpu": demand, "sources": src, **res}
    if args.png:
        out["png"] = plot(res, args.png, supply, demand, args.gpus)
    cols = [("targets", "T"), ("drafters", "D"), ("supply", "supply samples/s"), ("demand", "demand samples/s"),
            ("samples_per_s", "job samples/s"), ("per_gpu", "samples/s/GPU"), ("bottleneck", "bound by"),
            ("target_util", "target util"), ("drafter_util", "drafter util")]
    print(C.table(res["rows"], cols, title=f"split projection, W={args.gpus} (supply {supply:.3g}/target GPU, "
                                            f"demand {demand:.3g}/drafter GPU)"))
    b = res["best"]
    print(f"\nbest split: {b['targets']} target + {b['drafters']} drafter GPUs -> {b['samples_per_s']:.3g} samples/s "
          f"({b['per_gpu']:.3g} samples/s/GPU, bound by {b['bottleneck']}); continuous optimum "
          f"T* = {res['continuous_optimum_targets']:.2f}, ideal {res['ideal_samples_per_s']:.3g} samples/s")
    C.write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
