#!/usr/bin/env python3
"""The drafter's optimizer step alone: the gradient norm, the clip and AdamW over a drafter's parameters.

Each ``drafter.tuning.optimizer_step`` (``dflash_dist.drafter.optim``) from the same weights, gradients and moments:
``fused`` (the norm, then torch's fused AdamW with the clip factor as its ``grad_scale``), ``compiled`` (the
clip and torch's multi-tensor AdamW in one compiled region), and ``fused-noclip`` (torch's fused AdamW alone: the
floor of the fused kernel). Per mode: median ms of the step (CUDA events), the bytes a step must move (weight,
gradient and two fp32 moments read, weight and moments written: 28 bytes per parameter) over that time, and the
largest difference of its weights from the fused step's after ``--check-steps`` steps on the same gradients.

    python bench/optimizer_step.py --drafters dflash@8,dflash2@8 --out optimizer_step.json     # GPU, Qwen3-8B shapes
    python bench/optimizer_step.py --tiny --out /tmp/opt.json                                # CPU smoke
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (puts the repo root on sys.path)
import torch  # noqa: E402
from drafter_step import drafter_spec, drafter_variant_config  # noqa: E402

from dflash_dist.drafter.optim import make_step  # noqa: E402

BYTES_PER_PARAM = 28  # read p, g, m, v (fp32), write p, m, v


def build(label: str, tiny: bool, dev: torch.device, fused: bool):
    dc = drafter_variant_config(tiny, label)
    spec = drafter_spec(tiny, dc, dev.type)
    torch.manual_seed(0)
    with torch.device(dev):
        model = spec.build_model("sdpa")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=fused)
    g = torch.Generator(device=dev).manual_seed(1)
    grads = [torch.randn(p.shape, generator=g, device=dev) * 1e-3 for p in params]
    return model, params, opt, grads


def step_fn(mode: str, opt):
    """The step of ``mode``: ``step(params, max_norm) -> None``."""
    if mode == "fused-noclip":
        return lambda ps, _n: opt.step()
    return make_step(opt, mode)


def steps(step, params, grads, max_norm: float, n: int) -> None:
    """``n`` steps on the same gradients (the weights move; the gradients stay)."""
    for _ in range(n):
        for q, g in zip(params, grads):
            q.grad = g
        step(params, max_norm)
        for q in params:
            q.grad = None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized smoke run (tiny target shape)")
    p.add_argument("--drafters", default="dflash2@8", help="comma list of VARIANT@BLOCK (bench/drafter_step.py's)")
    p.add_argument("--modes", default="fused,compiled,fused-noclip", help="comma list of fused, compiled, fused-noclip")
    p.add_argument("--max-norm", type=float, default=0.5, help="clip norm (below the gradients' norm: clipping on)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--check-steps", type=int, default=3, help="steps compared against the fused mode's weights")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dev = C.pick_device(args.device)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    fused = dev.type == "cuda"
    result = {"bench": "optimizer_step", "env": C.env_info(dev), "tiny": args.tiny, "max_norm": args.max_norm,
              "bytes_per_param": BYTES_PER_PARAM, "rows": []}
    for label in [d.strip() for d in args.drafters.split(",") if d.strip()]:
        model, params, opt, grads = build(label, args.tiny, dev, fused)
        n = sum(q.numel() for q in params)
        C.log(f"{label}: {len(params)} tensors, {n / 1e6:.1f}M parameters")
        start = copy.deepcopy([q.detach().clone() for q in params])
        ref = None
        for mode in modes:
            with torch.no_grad():
                for q, s in zip(params, start):
                    q.copy_(s)
            opt.state.clear()
            row = {"drafter": label, "mode": mode, "tensors": len(params), "params": n}
            try:
                # the check: check_steps steps from the same start (the first one compiles, for compiled); then
                # the timed steps go on from there
                step = step_fn(mode, opt)
                t0 = time.perf_counter()
                steps(step, params, grads, args.max_norm, 1)
                C.sync(dev)
                first = time.perf_counter() - t0
                steps(step, params, grads, args.max_norm, args.check_steps - 1)
                snap = [q.detach().clone() for q in params]
                if mode == "fused":
                    ref = snap
                elif ref is not None and mode == "compiled":
                    row["max_abs_diff_vs_fused"] = max(float((a - b).abs().max()) for a, b in zip(snap, ref))
                    row["max_weight"] = max(float(b.abs().max()) for b in ref)
                del snap
                times = C.time_repeats(lambda s=step, ps=params, gs=grads: steps(s, ps, gs, args.max_norm, 1), dev,
                                       warmup=args.warmup, repeats=args.repeats)
                med = C.median(times)
                row.update({"ms": med * 1e3, "ms_min": min(times) * 1e3, "ms_max": max(times) * 1e3,
                            "first_step_s": first, "gb_per_s_of_28_bytes": BYTES_PER_PARAM * n / med / 1e9})
            except Exception as e:  # a mode that fails is a row with its error, the others still run
                row["error"] = C.short_error(e)
                C.log(f"{label} {mode}: {row['error']}")
            result["rows"].append(row)
            C.write_json(args.out, result)
        del model, params, opt, grads, start, ref
        C.free_memory(dev)
    print(C.table(result["rows"], [("drafter", "drafter"), ("mode", "mode"), ("params", "params"), ("ms", "ms"),
                                   ("ms_min", "min"), ("ms_max", "max"), ("gb_per_s_of_28_bytes", "GB/s (28 B/param)"),
                                   ("first_step_s", "1st step s"), ("max_abs_diff_vs_fused", "max |d| vs fused (JSON: exact)"),
                                   ("error", "error")],
                  title=f"optimizer step ({dev.type}, {'tiny' if args.tiny else 'Qwen3-8B'} shapes)"))
    return 0 if all("error" not in r for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
