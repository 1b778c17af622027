#!/usr/bin/env python3
"""One DFlash2 grouped dynamic convolution (both sides, as a layer runs it), forward + backward, compiled.

Formulations of the same math on the same weights and inputs:

- ``reduce``: the package's (``dflash_dist.model.variants.dflash2.layers.GroupedDynamicConv``): coefficients base + delta
  broadcast over the group's channels, so autograd makes the group sum and the base kernel's gradient
  reductions over [Q, H].
- ``triton``: one Triton kernel per direction (``bench/_conv_triton.py``; CUDA only). Measured no faster in the
  drafter step (docs/benchmarks.md#dflash2-step).
- ``matmul``: each tap's coefficients from one small matmul [delta_tap, 1] @ [E; base_tap] (``matmul_conv``
  below), so those two become matmuls. Measured slower on an H200 (docs/benchmarks.md#dflash2-step).
- ``blockpad``: rows viewed as whole blocks, each tap's shift a pad along the in-block axis (``blockpad_conv``).

Per formulation: median ms of a compiled forward + backward (CUDA events on GPU), and the largest difference of
the output and of every gradient from the ``reduce`` form in fp32.

    python bench/dflash2_conv.py --rows 4096 --out dflash2_conv.json      # GPU, Qwen3-8B shapes, 512 anchors x 8
    python bench/dflash2_conv.py --tiny                                   # CPU smoke
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (puts the repo root on sys.path)
import torch  # noqa: E402
from _conv_triton import available, grouped_dynamic_conv  # noqa: E402

from dflash_dist.model.variants.dflash2.layers import GroupedDynamicConv  # noqa: E402


def matmul_conv(conv: GroupedDynamicConv, x, delta, side: int, block_size: int):
    """The matmul form: each tap's coefficients [..., Q, H] from [delta_tap, 1] @ [E; base_tap] (E the 0/1 map of
    group to channel), so autograd's group sum and base-kernel gradient are matmuls instead of reductions."""
    q_len, hidden = x.shape[-2], x.shape[-1]
    pos = torch.arange(q_len, device=x.device) % block_size
    expand = (torch.arange(hidden, device=x.device) // conv.group_size
              == torch.arange(conv.num_groups, device=x.device)[:, None]).to(x.dtype)   # [G, H]
    ones = x.new_ones(*delta.shape[:-2], 1)
    base = conv.base_kernel[side].to(x.dtype)
    delta = delta.to(x.dtype)
    out = None
    for tap in range(conv.kernel_size):
        coef = torch.cat([delta[..., tap, :], ones], -1) @ torch.cat([expand, base[tap:tap + 1]], 0)
        if tap == 0:
            out = x * coef
            continue
        shifted = torch.cat([x.new_zeros(*x.shape[:-2], tap, hidden), x[..., :-tap, :]], dim=-2)
        out = out + shifted * (coef * (pos >= tap).to(x.dtype)[:, None])
    return out


def blockpad_conv(conv: GroupedDynamicConv, x, delta, side: int, block_size: int):
    """The block form: rows viewed as [..., blocks, B, G, g]; each tap's shift is a pad at the front of the
    in-block axis, so no row crosses a block and no 0/1 position mask is multiplied in."""
    q_len, hidden = x.shape[-2], x.shape[-1]
    lead = x.shape[:-2]
    nb = q_len // block_size
    xb = x.reshape(*lead, nb, block_size, conv.num_groups, conv.group_size)
    db = delta.to(x.dtype).reshape(*lead, nb, block_size, conv.kernel_size, conv.num_groups)
    base = conv.base_kernel[side].to(x.dtype).view(conv.kernel_size, conv.num_groups, conv.group_size)
    out = xb * (base[0] + db[..., 0, :, None])
    for tap in range(1, conv.kernel_size):
        shifted = torch.nn.functional.pad(xb[..., :-tap, :, :], (0, 0, 0, 0, tap, 0))
        out = out + shifted * (base[tap] + db[..., tap, :, None])
    return out.reshape(*lead, q_len, hidden)


def triton_conv(conv: GroupedDynamicConv, x, delta, side: int, block_size: int):
    """One Triton kernel per direction (``bench/_conv_triton.py``)."""
    return grouped_dynamic_conv(x, delta, conv.base_kernel[side], block_size, conv.group_size)


FORMS = {"reduce": lambda conv: conv._conv, "triton": lambda conv: (lambda *a: triton_conv(conv, *a)),
         "matmul": lambda conv: (lambda *a: matmul_conv(conv, *a)),
         "blockpad": lambda conv: (lambda *a: blockpad_conv(conv, *a))}


def both_sides(conv: GroupedDynamicConv, form: str, x, y, go, block_size: int):
    """prepare(x) and finish(y) as a layer runs them, reduced against a fixed output gradient ``go``."""
    conv_fn = FORMS[form](conv)
    delta = conv.kernel_projection(x).unflatten(-1, (2, conv.kernel_size, conv.num_groups))
    a = conv_fn(x, delta[..., 0, :, :], 0, block_size)
    b = conv_fn(y, delta[..., 1, :, :], 1, block_size)
    return (a.float() * go).sum() + (b.float() * go).sum(), a, b


def graph_us(fn, reps: int = 20) -> float:
    """Mean us of one ``fn()`` replayed from a CUDA graph of ``reps`` calls (no launch cost)."""
    fn()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                fn()
    torch.cuda.synchronize()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (5 * reps) * 1e3


def kernels_alone(conv: GroupedDynamicConv, x, go, block_size: int, group_size: int) -> dict:
    """One side's forward and backward kernels of the triton form, and a clone of x, replayed from CUDA graphs."""
    import _conv_triton as T
    x2 = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        delta = conv.kernel_projection(x2.float()).to(x.dtype).unflatten(-1, (2, conv.kernel_size,
                                                                              conv.num_groups))[:, 0]
    base = conv.base_kernel[0].detach()
    return {"us_fwd_kernel": graph_us(lambda: T._conv_fwd(x2, delta, base, block_size, group_size)),
            "us_bwd_kernel": graph_us(lambda: T._conv_bwd(go.reshape(x2.shape), x2, delta, base, block_size,
                                                          group_size)),
            "us_clone": graph_us(lambda: x2.clone())}


def grads(conv, form, x, y, go, block_size):
    for p in conv.parameters():
        p.grad = None
    x, y = x.detach().requires_grad_(), y.detach().requires_grad_()
    loss, a, b = both_sides(conv, form, x, y, go, block_size)
    loss.backward()
    return [a.detach(), b.detach(), x.grad, y.grad] + [p.grad for p in conv.parameters()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized smoke run")
    p.add_argument("--rows", type=int, default=4096, help="query rows (anchors x block size)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--kernel-size", type=int, default=2)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--forms", default="reduce,triton,matmul,blockpad", help=f"comma list of {', '.join(FORMS)}")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="inputs and output gradient (the layer's activations; bf16 autocast on CUDA either way)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.rows, args.hidden, args.repeats, args.warmup = 64, 64, 3, 1
    dev = C.pick_device(args.device)
    if args.dtype == "bf16" and dev.type != "cuda":
        p.error("--dtype bf16 needs CUDA (the bf16 autocast of the projection)")
    torch.manual_seed(0)
    conv = GroupedDynamicConv(args.hidden, args.kernel_size, args.group_size).to(dev)
    with torch.no_grad():  # away from the identity init, so every term counts
        conv.base_kernel.normal_(0, 0.5)
        conv.kernel_projection.weight.normal_(0, 0.02)
    x, y = (torch.randn(1, args.rows, args.hidden, device=dev) for _ in range(2))
    go = torch.randn(1, args.rows, args.hidden, device=dev)
    if args.dtype == "bf16":  # the fp32 reference below then sees the same (bf16-rounded) values
        x, y, go = (t.bfloat16().float() for t in (x, y, go))
        xs, ys, gos = (t.bfloat16() for t in (x, y, go))
    else:
        xs, ys, gos = x, y, go
    result = {"bench": "dflash2_conv", "env": C.env_info(dev), "shape": vars(args), "rows": []}
    ref = grads(conv, "reduce", x, y, go, args.block_size)  # fp32, eager
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    for form in [f.strip() for f in args.forms.split(",") if f.strip()]:
        if form == "triton" and not available(x, args.group_size, args.hidden):
            C.log("triton: needs CUDA, triton and a power-of-two group that tiles the hidden size; skipped")
            continue
        got = grads(conv, form, x, y, go, args.block_size)
        diff = max(float((g - r).abs().max()) for g, r in zip(got, ref))
        step = torch.compile(lambda xx, yy, form=form: both_sides(conv, form, xx, yy, gos, args.block_size)[0],
                             fullgraph=True)
        xb, yb = xs.detach().requires_grad_(), ys.detach().requires_grad_()

        def run():
            for q in conv.parameters():
                q.grad = None
            with amp:
                loss = step(xb, yb)
            loss.backward()

        ms = C.median(C.time_repeats(run, dev, args.warmup, args.repeats)) * 1e3
        row = {"form": form, "ms_fwd_bwd": ms, "max_abs_diff_vs_reduce_fp32": diff}
        if form == "triton":  # the kernels alone, launch cost excluded, next to a copy of the same bytes
            row.update(kernels_alone(conv, xs, gos, args.block_size, args.group_size))
        result["rows"].append(row)
        C.log(f"{form}: {ms:.3f} ms forward+backward (compiled, bf16 autocast on CUDA); max |d| vs reduce {diff:.2e}")
    print(C.table(result["rows"], [("form", "form"), ("ms_fwd_bwd", "ms fwd+bwd"),
                                   ("max_abs_diff_vs_reduce_fp32", "max |d| fp32"),
                                   ("us_fwd_kernel", "us fwd kernel"), ("us_bwd_kernel", "us bwd kernel"),
                                   ("us_clone", "us clone")],
                  title=f"DFlash2 conv, {args.rows} rows x {args.hidden}, k={args.kernel_size} g={args.group_size}"))
    C.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
