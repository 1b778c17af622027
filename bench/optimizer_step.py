#!/usr/bin/env python3
"""The drafter's optimizer step alone: the gradient norm, the clip and AdamW over a drafter's parameters.

Each ``drafter.tuning.optimizer_step`` (``dflash_dist.roles.drafter_rank.optim``) from the same weights, gradients and moments:
``fused`` (the norm, then torch's fused AdamW with the clip factor as its ``grad_scale``), ``compiled`` (the
clip and torch's multi-tensor AdamW in one compiled region), and ``fused-noclip`` (torch's fused AdamW alone: the
floor of the fused kernel). Two modes that are not the package's, for what a different layout would give:
``flat`` (the same clip and AdamW over one flat fp32 buffer each of weights, gradients and moments: one norm, then
one compiled elementwise region; what a flat parameter store would let the step run) and ``copy`` (one copy of a
flat fp32 buffer of as many elements: the memory bandwidth a streaming kernel reaches on this device, 8 bytes per
parameter). Per mode: median ms of the step (CUDA events), the bytes a step must move (weight, gradient and two
fp32 moments read, weight and moments written: 28 bytes per parameter) over that time, and the largest difference
of its weights from the fused step's after ``--check-steps`` steps on the same gradients.

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

from dflash_dist.roles.drafter_rank.optim import clip_factor, make_step  # noqa: E402

BYTES_PER_PARAM = 28  # read p, g, m, v (fp32), write p, m, v
COPY_BYTES_PER_PARAM = 8  # the copy mode: read and write one fp32 value


def _flat_adamw(p, g, m, v, step, factor, lr, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """torch's AdamW (decoupled weight decay, bias corrections) on the clipped gradient, over flat buffers, in place;
    ``step``, ``factor`` and ``lr`` are device scalars (a new value compiles nothing)."""
    step.add_(1)
    g = g * factor
    p.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias1 = 1 - beta1 ** step
    bias2_sqrt = (1 - beta2 ** step).sqrt()
    p.sub_((lr / bias1) * m / (v.sqrt() / bias2_sqrt + eps))


class FlatClippedAdamW:
    """The ``flat`` mode: the gradients' norm over one flat buffer, then ``_flat_adamw`` compiled (fullgraph) over
    flat copies of the weights, the gradients and two zero moments. The model's own tensors are not touched:
    ``weights()`` gives the updated weights in their shapes."""

    def __init__(self, opt, params: list, grads: list):
        group = opt.param_groups[0]
        dev = params[0].device
        self.shapes = [q.shape for q in params]
        self.p = torch.cat([q.detach().reshape(-1) for q in params])
        self.g = torch.cat([g.reshape(-1) for g in grads])
        self.m, self.v = torch.zeros_like(self.p), torch.zeros_like(self.p)
        self.step = torch.zeros((), dtype=torch.float32, device=dev)
        self.lr = torch.tensor(float(group["lr"]), dtype=torch.float32, device=dev)
        beta1, beta2 = group["betas"]
        self.hyper = (float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]))
        self._fn = torch.compile(_flat_adamw, fullgraph=True)

    def __call__(self, params: list, max_norm: float):
        gnorm = torch.linalg.vector_norm(self.g)
        with torch.no_grad():
            self._fn(self.p, self.g, self.m, self.v, self.step, clip_factor(gnorm, max_norm), self.lr, *self.hyper)
        return gnorm

    def weights(self) -> list:
        return [w.view(shape) for w, shape in zip(self.p.split([s.numel() for s in self.shapes]), self.shapes)]


def copy_fn(n: int, dev: torch.device):
    """The ``copy`` mode: ``dst.copy_(src)`` over n fp32 elements."""
    src, dst = torch.ones(n, device=dev), torch.empty(n, device=dev)
    return lambda _ps, _n: dst.copy_(src)


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


def step_fn(mode: str, opt, params: list, grads: list):
    """The step of ``mode``: ``step(params, max_norm) -> None``."""
    if mode == "fused-noclip":
        return lambda ps, _n: opt.step()
    if mode == "flat":
        return FlatClippedAdamW(opt, params, grads)
    if mode == "copy":
        return copy_fn(sum(q.numel() for q in params), params[0].device)
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
    p.add_argument("--modes", default="fused,compiled,fused-noclip",
                   help="comma list of fused, compiled, fused-noclip, flat, copy (the last two: see the docstring)")
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
                step = step_fn(mode, opt, params, grads)
                t0 = time.perf_counter()
                steps(step, params, grads, args.max_norm, 1)
                C.sync(dev)
                first = time.perf_counter() - t0
                steps(step, params, grads, args.max_norm, args.check_steps - 1)
                if mode != "copy":  # the copy moves no weight
                    snap = [w.detach().clone() for w in (step.weights() if hasattr(step, "weights") else params)]
                    if mode == "fused":
                        ref = snap
                    elif ref is not None:
                        row["max_abs_diff_vs_fused"] = max(float((a - b).abs().max()) for a, b in zip(snap, ref))
                        row["max_weight"] = max(float(b.abs().max()) for b in ref)
                    del snap
                times = C.time_repeats(lambda s=step, ps=params, gs=grads: steps(s, ps, gs, args.max_norm, 1), dev,
                                       warmup=args.warmup, repeats=args.repeats)
                med = C.median(times)
                moved = COPY_BYTES_PER_PARAM if mode == "copy" else BYTES_PER_PARAM
                row.update({"ms": med * 1e3, "ms_min": min(times) * 1e3, "ms_max": max(times) * 1e3,
                            "first_step_s": first, "bytes_per_param": moved, "gb_per_s": moved * n / med / 1e9})
                if mode != "copy":
                    row["gb_per_s_of_28_bytes"] = row["gb_per_s"]
                del step
            except Exception as e:  # a mode that fails is a row with its error, the others still run
                row["error"] = C.short_error(e)
                C.log(f"{label} {mode}: {row['error']}")
            result["rows"].append(row)
            C.write_json(args.out, result)
        del model, params, opt, grads, start, ref
        C.free_memory(dev)
    print(C.table(result["rows"], [("drafter", "drafter"), ("mode", "mode"), ("params", "params"), ("ms", "ms"),
                                   ("ms_min", "min"), ("ms_max", "max"), ("gb_per_s", "GB/s (bytes moved)"),
                                   ("first_step_s", "1st step s"), ("max_abs_diff_vs_fused", "max |d| vs fused (JSON: exact)"),
                                   ("error", "error")],
                  title=f"optimizer step ({dev.type}, {'tiny' if args.tiny else 'Qwen3-8B'} shapes)"))
    return 0 if all("error" not in r for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
