#!/usr/bin/env python3
"""Autotune the drafter's flex_attention tiles for one step shape and print ``drafter.tuning.flex_kernel_options``.

The drafter's attention at Qwen3-8B shapes (32 query heads, 8 KV heads, head_dim 128, bf16) with the real DFlash
BlockMask of a step (``blocks.make_batch`` + ``masks.flex_block_mask``). Three variants, each timed forward and
forward+backward (median of --repeats, CUDA events):

  default    the trainer's kernel: torch.compile(flex_attention, fullgraph, dynamic) with inductor's tiles;
  autotuned  torch.compile(..., mode="max-autotune-no-cudagraphs"): inductor benchmarks its candidate tiles for
             the forward and the backward kernel; the winners are read from its AUTOTUNE report;
  explicit   the trainer's dynamic kernel again, with the winners passed as kernel_options (fwd_*/bwd_*): what
             ``drafter.tuning.flex_kernel_options=<printed dict>`` runs.

    python bench/flex_tune.py --out flex_tune.json                 # CUDA; then
    python bench/drafter_step.py --backends flex_layers,flex_layers+ko --kernel-options flex_tune.json
    python bench/flex_tune.py --config 32768x1024 --no-autotune \
        --candidates '[{"USE_TMA": true}, {"bwd_num_warps": 4}]'     # given tile options against the defaults
    python bench/flex_tune.py --no-autotune --candidates '[{"BACKEND": "FLASH"}]' --static
                                              # another flex backend (FlashAttention-4's, flash-attn-4 installed)

Every candidate's output and q/k/v gradients are compared with the default kernel's on the same inputs
(``rel_err_*``: ||x - x_default|| / ||x_default||; bf16 kernels of the same math land near 1e-3). ``--static``
compiles the candidates with static shapes (a backend without dynamic-shape support).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import torch  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402

from dflash_dist.model.blocks import make_batch  # noqa: E402
from dflash_dist.model.masks import flex_block_mask  # noqa: E402

# tile options worth carrying over from inductor's autotune report (the rest describe the problem, not the tiles)
TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps", "num_stages")
_ROW = re.compile(r"^\s+(\S+)\s+([0-9.]+) ms\s+([0-9.]+)%\s*(.*)$")


def parse_autotune(report: str) -> dict:
    """Winning tiles per kernel from inductor's 'AUTOTUNE <name>(...)' blocks (first row = fastest)."""
    best: dict = {}
    kernel = None
    for line in report.splitlines():
        if line.startswith("AUTOTUNE "):
            kernel = line[len("AUTOTUNE "):].split("(")[0]
            continue
        m = _ROW.match(line)
        if kernel and m and kernel not in best:
            pairs = dict(re.findall(r"(\w+)=([\w.']+)", m.group(4)))
            best[kernel] = {"choice": m.group(1), "ms": float(m.group(2)),
                            "tiles": {k: int(v) for k, v in pairs.items() if k in TILE_KEYS and v.isdigit()}}
    return best


def kernel_options_from(best: dict) -> dict:
    """fwd_/bwd_-prefixed kernel_options from the winners (flex_attention = forward, *_backward = backward)."""
    opts: dict = {}
    for kernel, res in best.items():
        prefix = "bwd_" if "backward" in kernel else "fwd_" if "flex_attention" in kernel else None
        if prefix:
            opts.update({prefix + k: v for k, v in res["tiles"].items()})
    return opts


def time_fn(fn, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return C.median(times)


def problem(ctx: int, anchors: int, b: int, heads: int, kv_heads: int, d: int, block: int, device):
    """q/k/v of one drafter layer and the step's BlockMask (random ids; 30% prompt without loss)."""
    g = torch.Generator().manual_seed(ctx + anchors)
    ids = torch.randint(0, 1000, (b * ctx,), generator=g).to(device)
    loss_mask = (torch.arange(ctx).repeat(b) >= int(0.3 * ctx)).to(device)
    cu = (torch.arange(b + 1) * ctx).to(device)
    feats = torch.zeros(b * ctx, 8, device=device, dtype=torch.bfloat16)
    batch = make_batch(ids, loss_mask, cu, feats, num_anchors=anchors, block_size=block, mask_token_id=999,
                       ctx_bucket=256, generator=torch.Generator().manual_seed(7))
    # dynamic: the static mask builder takes minutes to compile at these sizes (the trainer's CUDA path is dynamic)
    mask = flex_block_mask(batch.anchors, batch.valid, batch.ctx_len, block, compile=True, dynamic=True)
    q_len, k_len = anchors * block, batch.ctx_len + anchors * block
    mk = lambda h, n: torch.randn(b, h, n, d, device=device, dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    return mk(heads, q_len), mk(kv_heads, k_len), mk(kv_heads, k_len), mask


def measure(fn, q, k, v, mask, opts, repeats: int, keep: Optional[dict] = None) -> dict:
    """First-call, forward and forward+backward times of ``fn``; ``keep``: filled with its output and the q/k/v
    gradients of one call (the check against the default kernel)."""
    grad = torch.randn(q.shape, device=q.device, dtype=q.dtype, generator=torch.Generator(q.device).manual_seed(11))

    def fwd():
        with torch.no_grad():
            fn(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=opts)

    def fwd_bwd():
        out = fn(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=opts)
        out.backward(grad)

    t0 = time.perf_counter()
    fwd_bwd()
    fwd()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    if keep is not None:
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=opts)
        out.backward(grad)
        keep.update(out=out.detach().float(), dq=q.grad.float(), dk=k.grad.float(), dv=v.grad.float())
    for _ in range(2):
        fwd_bwd()
    return {"first_call_s": first, "fwd_ms": time_fn(fwd, repeats), "fwd_bwd_ms": time_fn(fwd_bwd, repeats)}


def rel_errors(got: dict, ref: dict) -> dict:
    """||got - ref|| / ||ref|| of the output and each gradient (NaN anywhere is reported as inf)."""
    out = {}
    for name, r in ref.items():
        d = (got[name] - r).norm() / r.norm().clamp_min(1e-30)
        out[f"rel_err_{name}"] = float(d) if torch.isfinite(d) else float("inf")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="3072x512", help="CTXxANCHORS of the tuned step (default 3072x512)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--candidates", default=None,
                   help="JSON list of kernel_options dicts (or the path of a file holding one), each timed with the "
                        "trainer's kernel against the defaults")
    p.add_argument("--no-autotune", action="store_true", help="skip inductor's max-autotune (minutes at long context)")
    p.add_argument("--static", action="store_true",
                   help="compile the candidates with static shapes (the default kernel stays dynamic, as trained)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("flex_tune.py needs a CUDA GPU (inductor's flex templates are tuned for the GPU)", file=sys.stderr)
        return 2
    dev = C.pick_device("cuda")
    ctx, anchors = (int(x) for x in args.config.split("x"))
    q, k, v, mask = problem(ctx, anchors, args.batch, args.heads, args.kv_heads, args.head_dim, args.block_size, dev)
    res: dict = {"bench": "flex_tune", "env": C.env_info(dev), "config": args.config, "batch": args.batch,
                 "shape": {"q": list(q.shape), "k": list(k.shape)}, "mask_block": list(mask.BLOCK_SIZE),
                 "mask_sparsity": float(mask.sparsity()),
                 "variants": {}}
    C.log(f"q {tuple(q.shape)} k {tuple(k.shape)}, mask sparsity {res['mask_sparsity']:.1f}%")

    torch._dynamo.reset()
    ref: dict = {}
    res["variants"]["default"] = measure(torch.compile(flex_attention, fullgraph=True, dynamic=True),
                                         q, k, v, mask, None, args.repeats, keep=ref)
    C.log(f"default: {res['variants']['default']}")

    for i, cand in enumerate(load_candidates(args.candidates)):
        torch._dynamo.reset()
        name = f"candidate{i}"
        got: dict = {}
        try:
            r = measure(torch.compile(flex_attention, fullgraph=True, dynamic=not args.static), q, k, v, mask, cand,
                        args.repeats, keep=got)
            r.update(rel_errors(got, ref))
        except Exception as e:  # a tile the template refuses (shared memory, divisibility): reported, not fatal
            r = {"error": C.short_error(e), "fwd_ms": float("nan"), "fwd_bwd_ms": float("nan"), "first_call_s": 0.0}
        res["variants"][name] = {**r, "kernel_options": cand, "dynamic": not args.static}
        C.log(f"{name} {cand}: {r}")
    opts = {}
    if not args.no_autotune:
        opts = autotune(res, q, k, v, mask, args.repeats)
    base = res["variants"]["default"]["fwd_bwd_ms"]
    rows = [{"variant": name, **r, "speedup_fwd_bwd": base / r["fwd_bwd_ms"]} for name, r in res["variants"].items()]
    print()
    print(C.table(rows, [("variant", "variant"), ("fwd_ms", "fwd ms"), ("fwd_bwd_ms", "fwd+bwd ms"),
                         ("speedup_fwd_bwd", "x default"), ("first_call_s", "1st call s"),
                         ("rel_err_out", "rel err out"), ("rel_err_dq", "dq"), ("rel_err_dk", "dk"),
                         ("rel_err_dv", "dv")],
                  title=f"flex_attention one drafter layer, {args.config}, b={args.batch} ({res['env'].get('gpu')})"))
    print(f"\ndrafter.flex_kernel_options={opts if opts else 'null'}")
    C.write_json(args.out, res)
    return 0


def autotune(res: dict, q, k, v, mask, repeats: int) -> dict:
    """inductor's max-autotune of the flex tiles, then its winners as explicit kernel_options (into res)."""
    torch._dynamo.reset()
    report = io.StringIO()
    with contextlib.redirect_stderr(report):
        tuned = measure(torch.compile(flex_attention, fullgraph=True, dynamic=True,
                                      mode="max-autotune-no-cudagraphs"), q, k, v, mask, None, repeats)
    res["variants"]["autotuned"] = tuned
    best = parse_autotune(report.getvalue())
    opts = kernel_options_from(best)
    res["autotune_winners"], res["best_kernel_options"] = best, opts
    res["autotune_report_tail"] = report.getvalue()[-4000:]
    C.log(f"autotuned: {tuned}; winners: {best}")

    if opts:
        torch._dynamo.reset()
        res["variants"]["explicit"] = measure(torch.compile(flex_attention, fullgraph=True, dynamic=True),
                                              q, k, v, mask, opts, repeats)
        C.log(f"explicit: {res['variants']['explicit']}")
    else:
        C.log("no tile winners parsed from the autotune report (see autotune_report_tail in the JSON)")
    return opts


def load_candidates(arg):
    """--candidates: a JSON list of kernel_options dicts, or the path of a file holding one."""
    if not arg:
        return []
    text = open(arg).read() if os.path.exists(arg) else arg
    cands = json.loads(text)
    if not isinstance(cands, list) or not all(isinstance(c, dict) for c in cands):
        raise SystemExit("--candidates: need a JSON list of kernel_options dicts")
    return cands


if __name__ == "__main__":
    sys.exit(main())
