#!/usr/bin/env python3
"""One drafter training step per objective (``drafter.loss.*``): ms/step of each next to the decayed CE's.

The step is bench/drafter_step.py's (``Runner.step``: make_batch, mask, drafter forward, loss, backward, clip,
AdamW, bf16 autocast on CUDA), with the loss through the objective object as ``DrafterTrainer`` calls it:

* ``decay``: decayed CE on the data's labels (today's default);
* ``dpace``: ``drafter.loss.weighting=dpace`` (D-PACE weights from the drafter's own confidences);
* ``target``: ``drafter.loss.labels=target``, the target's greedy token per position (what the drafter pays:
  the labels come with the message, here random ids made before the step);
* ``kl``: ``drafter.loss.kind=kl`` on the target's top-``--kl-top-k`` distribution (random ids and probabilities).

Each drafter of ``--drafters`` (VARIANT@BLOCK) runs every objective at each ``--configs`` CTXxANCHORS and batch;
the table gives ms/step and the ratio to ``decay`` of the same drafter and shape. Target-side costs (the full
forward and lm_head for the target's labels) are bench/target_labels.py's.

    python bench/objectives.py --out objectives.json            # CUDA: Qwen3-8B shape, dflash@16 and dflash2@8, 3072x512
    python bench/objectives.py --tiny --configs 256x32 --out /tmp/obj.json   # CPU smoke (sdpa, tiny shape)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import drafter_step as DS  # noqa: E402
import torch  # noqa: E402

from dflash_dist.config import DrafterLoss  # noqa: E402

OBJECTIVES = {"decay": {}, "dpace": {"weighting": "dpace"}, "target": {"labels": "target"},
              "kl": {"labels": "target", "kind": "kl"}}


def objective_config(tiny: bool, entry: str, loss: dict):
    """The DrafterConfig of ``VARIANT@BLOCK`` (bench/drafter_step.py's) with ``loss`` set on ``drafter.loss``."""
    dc = DS.drafter_variant_config(tiny, entry)
    dc.loss = DrafterLoss(**{**dc.loss.__dict__, **loss})
    return dc


def target_inputs(loss: DrafterLoss, tokens: int, vocab: int, device, seed: int) -> dict:
    """make_batch's target_ids / target_probs as a message under ``loss`` carries them (nothing for the data's
    labels): k ids per token (k = kl_top_k for kind=kl, else 1) and, for kl, probabilities summing to 1."""
    if loss.labels != "target":
        return {}
    k = loss.kl_top_k if loss.kind == "kl" else 1
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, vocab, (tokens, k), generator=g, device=device)
    probs = torch.softmax(torch.randn(tokens, k, generator=g, device=device), -1) if loss.kind == "kl" else None
    return {"target_ids": ids, "target_probs": probs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized run (tiny target shape, the tiny drafter preset)")
    p.add_argument("--out", default=None, help="JSON output path (rewritten after every row)")
    p.add_argument("--device", default="auto")
    p.add_argument("--drafters", default="dflash@16,dflash2@8", help="comma list of VARIANT@BLOCK")
    p.add_argument("--objectives", default=",".join(OBJECTIVES), help=f"comma list of {', '.join(OBJECTIVES)}")
    p.add_argument("--configs", default="3072x512", help="CTXxANCHORS list")
    p.add_argument("--batch", default="1", help="samples per step, comma list")
    p.add_argument("--backend", default=None, help="flex_layers (CUDA default), flex, sdpa (CPU: sdpa)")
    p.add_argument("--kl-top-k", type=int, default=20, help="drafter.loss.kl_top_k of the kl rows")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps incl. the first (default 3; tiny 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps (default 10; tiny 3)")
    p.add_argument("--prompt-frac", type=float, default=0.3, help="leading share of each sample without loss")
    p.add_argument("--lr", type=float, default=1e-4)
    args = p.parse_args(argv)
    args.profile = ""  # run_one's per-config profile: not here
    args.trace = None  # run_one's traced step: not here
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.repeats = args.repeats if args.repeats is not None else (3 if args.tiny else 10)
    dev = C.pick_device(args.device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = args.backend or ("flex_layers" if dev.type == "cuda" else "sdpa")
    if dev.type == "cpu" and backend.startswith("flex"):
        raise SystemExit("flex_attention has no backward on CPU: use --backend sdpa")
    import torch._dynamo as _dynamo  # noqa: F401  (a bare `import torch._dynamo` here would make `torch` local)
    for key in ("recompile_limit", "cache_size_limit"):  # the name differs between torch versions
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, 64)
            break
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    batches = [int(x) for x in args.batch.split(",")]
    names = [x.strip() for x in args.objectives.split(",") if x.strip()]
    unknown = [n for n in names if n not in OBJECTIVES]
    if unknown:
        raise SystemExit(f"--objectives: unknown {unknown}; use {list(OBJECTIVES)}")
    peak = C.peak_matmul_tflops(dev, n=256 if args.tiny else 8192)
    nominal = C.nominal_peak_tflops(dev)
    result = {"bench": "objectives", "env": C.env_info(dev), "tiny": args.tiny, "backend": backend,
              "kl_top_k": args.kl_top_k, "peak_matmul": peak, "warmup": args.warmup, "repeats": args.repeats,
              "rows": []}
    t0 = time.time()
    for entry in [d.strip() for d in args.drafters.split(",") if d.strip()]:
        for name in names:
            loss = dict(OBJECTIVES[name], **({"kl_top_k": args.kl_top_k} if name == "kl" else {}))
            dc = objective_config(args.tiny, entry, loss)
            runner = DS.Runner(DS.drafter_spec(args.tiny, dc, dev.type), dc, dev, args.lr,
                               dynamic=dev.type == "cuda", tcfg=DS.target_of(args.tiny))
            runner.use_objective, runner.label = True, entry
            for ctx, anchors in configs:
                for b in batches:
                    runner.target_inputs = target_inputs(dc.loss, ctx * b, runner.mc.vocab_size, dev, seed=ctx + b)
                    C.log(f"run {entry} {name} ({runner.objective.describe()}) ctx={ctx} anchors={anchors} b={b}")
                    row = DS.run_one(runner, ctx, anchors, b, backend, True, args, peak, nominal)
                    row["objective"], row["describe"] = name, runner.objective.describe()
                    if "error" not in row:  # the last step's loss sum: each objective's own number
                        row["loss_sum"] = float(runner.last_loss_sum)
                    result["rows"].append(row)
                    if "error" not in row:
                        C.log(f"  {row['ms_per_step']:.1f} ms/step, peak mem {row['peak_mem_gb']} GB")
                    result["wall_s"] = time.time() - t0
                    C.write_json(args.out, result)
            del runner
            C.free_memory(dev)
    base = {(r["drafter"], r["ctx"], r["anchors"], r["batch"]): r.get("ms_per_step") for r in result["rows"]
            if r["objective"] == "decay"}
    for r in result["rows"]:
        ref = base.get((r["drafter"], r["ctx"], r["anchors"], r["batch"]))
        r["vs_decay"] = r["ms_per_step"] / ref if ref and r.get("ms_per_step") else None
    cols = [("drafter", "drafter"), ("objective", "objective"), ("ctx", "ctx"), ("anchors", "anchors"),
            ("batch", "b"), ("ms_per_step", "ms/step"), ("ms_per_step_back_to_back", "ms/step b2b"),
            ("vs_decay", "x decay"), ("peak_mem_gb", "peak GB"), ("first_step_s", "1st step s"), ("error", "error")]
    print()
    print(C.table(result["rows"], cols, title=f"drafter step per objective ({'tiny' if args.tiny else 'Qwen3-8B-shaped'}, "
                                              f"{dev.type}, {backend}, kl top-{args.kl_top_k})"))
    result["wall_s"] = time.time() - t0
    C.write_json(args.out, result)
    return 0 if all("error" not in r for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
