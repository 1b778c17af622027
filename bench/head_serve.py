#!/usr/bin/env python3
"""What one served head request costs a target: ``loss.frozen_head_ce`` (logits, decayed CE, argmax and the
gradient wrt the rows, chunk by chunk) on R rows through a frozen [V, H] head, by chunk height and compiled or not.

With ``drafter.tuning.loss_on_target`` a target serves each anchor group's rows this way; on 2x H200 (8B shapes,
torch 2.11, 2026-11-30) the job measured 45 ms per 7,680-row request = 425 TFLOP/s, and the drafter waited for it: the serve's speed sets what the
offload gains (docs/benchmarks.md, "The frozen lm_head and loss on the target"). FLOPs: 4 x R x H x V (logits and
row gradient); the matmul peak of the same GPU is measured first, so the table also gives the fraction of it.

``--slices K``: also the vocab-parallel serve of a target replica of K ranks (model/head_shards.py): one rank's
``serve_slice`` over V/K head rows, the drafter's ``ce_from_slices`` of the K replies, and how far the combined loss
and gradient are from the whole head's (same rows, same dtype).

    python bench/head_serve.py --out head_serve.json                    # CUDA: Qwen3-8B head, 3 row counts
    python bench/head_serve.py --slices 2 --rows 7680 --chunk-rows 4096 --out head_slices.json
    python bench/head_serve.py --tiny --slices 2 --out /tmp/hs.json     # CPU smoke
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import torch  # noqa: E402

from dflash_dist.comm.head_offload import head_flops  # noqa: E402
from dflash_dist.model.head_shards import ce_from_slices, serve_slice, vocab_slice  # noqa: E402
from dflash_dist.model.loss import frozen_head_ce, row_weights  # noqa: E402
from dflash_dist.model.objectives import paper_gamma  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def sliced_row(x, weight, y, w, chunk: int, k: int, dev, warmup: int, repeats: int) -> dict:
    """One rank's serve of its 1/k of the vocabulary and the drafter's combine of the k replies, timed; the
    combined weighted loss and gradient against the whole head's (frozen_head_ce, eager)."""
    v, (r, h) = weight.shape[0], x.shape
    bounds = [vocab_slice(v, k, i) for i in range(k)]
    row = {"rows": r, "chunk_rows": chunk, "compiled": False, "slices": k}
    try:
        C.reset_peak(dev)
        lo, hi = bounds[0]
        shard = weight[lo:hi].contiguous()
        row["slice_ms"] = C.median(C.time_repeats(lambda: serve_slice(x, shard, lo, y[:, None], chunk), dev, warmup,
                                                  repeats)) * 1e3
        row["slice_tflops"] = head_flops(r, h, hi - lo) / (row["slice_ms"] / 1e3) / 1e12
        replies = [serve_slice(x, weight[a:b], a, y[:, None], chunk) for a, b in bounds]
        row["combine_ms"] = C.median(C.time_repeats(lambda: ce_from_slices(replies, weight, y), dev, warmup,
                                                    repeats)) * 1e3
        row["peak_gb"] = C.mem_gb(dev).get("peak_gb")
        ce, _, grad = ce_from_slices(replies, weight, y)
        loss_ref, _, grad_ref = frozen_head_ce(x, weight, y, w, chunk, False)
        loss = (w * ce).sum()
        row["loss_rel_diff"] = float((loss - loss_ref).abs() / loss_ref.abs())
        row["grad_rel_diff"] = float((grad * w[:, None] - grad_ref.float()).norm() / grad_ref.float().norm())
    except Exception as e:
        row["error"] = C.short_error(e)
    C.log(f"rows {r} chunk {chunk}, {k} slices: " + (f"one slice {row['slice_ms']:.2f} ms, combine "
                                                     f"{row['combine_ms']:.2f} ms, loss rel. diff "
                                                     f"{row['loss_rel_diff']:.2e}, grad {row['grad_rel_diff']:.2e}"
                                                     if "combine_ms" in row else row["error"]))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized smoke run")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--rows", default=None, help="rows per request (default 3840,7680,15360; tiny 150,300)")
    p.add_argument("--chunk-rows", default=None, help="drafter.tuning.loss_chunk_rows values (default 2048,4096,8192)")
    p.add_argument("--hidden", type=int, default=None, help="H (4096; tiny 64)")
    p.add_argument("--vocab", type=int, default=None, help="V (151936; tiny 1000)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=None, help="timed calls (10; tiny 2)")
    p.add_argument("--slices", type=int, default=0, help="K > 1: also the vocab-parallel serve of K ranks")
    args = p.parse_args(argv)
    t = args.tiny
    dev = C.pick_device("cpu" if t else args.device)
    rows_list = ints(args.rows or ("150,300" if t else "3840,7680,15360"))
    chunks = ints(args.chunk_rows or ("64,128" if t else "2048,4096,8192"))
    h, v = args.hidden or (64 if t else 4096), args.vocab or (1000 if t else 151936)
    repeats = args.repeats or (2 if t else 10)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    compiled_opts = [False, True] if dev.type == "cuda" else [False]  # inductor on CPU: slow to build, not served
    out = {"bench": "head_serve", "env": C.env_info(dev), "hidden": h, "vocab": v, "dtype": str(dtype),
           "peak": C.peak_matmul_tflops(dev, n=256 if t else 8192), "rows": []}
    g = torch.Generator(device=dev).manual_seed(0)
    weight = torch.randn(v, h, dtype=dtype, device=dev, generator=g) * 0.02
    bsz = args.block_size
    for r in rows_list:
        r -= r % (bsz - 1)  # whole blocks of B-1 loss rows, as a drafter sends them
        x = torch.randn(r, h, dtype=dtype, device=dev, generator=g)
        y = torch.randint(0, v, (r,), device=dev, generator=g)
        y[::7] = -100  # some rows without a label, as padding blocks and prompts give
        w = row_weights(y, bsz, paper_gamma(bsz))
        for chunk in chunks:
            for compiled in compiled_opts:
                row = {"rows": r, "chunk_rows": chunk, "compiled": compiled}
                try:
                    C.reset_peak(dev)
                    times = C.time_repeats(lambda: frozen_head_ce(x, weight, y, w, chunk, compiled), dev,
                                           args.warmup, repeats)
                    ms = C.median(times) * 1e3
                    tflops = head_flops(r, h, v) / (ms / 1e3) / 1e12
                    row.update(ms=ms, tflops=tflops, of_peak=tflops / out["peak"]["tflops"],
                               peak_gb=C.mem_gb(dev).get("peak_gb"))
                except Exception as e:  # an OOM or a compile failure is a result here, not the end of the run
                    row["error"] = C.short_error(e)
                out["rows"].append(row)
                C.log(f"rows {r} chunk {chunk} compiled {compiled}: "
                      + (f"{row['ms']:.2f} ms, {row['tflops']:.1f} TFLOP/s" if "ms" in row else row["error"]))
                C.write_json(args.out, out)
            if args.slices > 1:
                out["rows"].append(sliced_row(x, weight, y, w, chunk, args.slices, dev, args.warmup, repeats))
                C.write_json(args.out, out)
    print(C.table(out["rows"], [("rows", "rows"), ("chunk_rows", "chunk rows"), ("compiled", "compiled"),
                                ("slices", "slices"),
                                ("ms", "ms"), ("tflops", "TFLOP/s"), ("of_peak", "of matmul peak"),
                                ("peak_gb", "peak GB"), ("slice_ms", "one slice ms"),
                                ("combine_ms", "combine ms"), ("loss_rel_diff", "loss rel. diff"),
                                ("grad_rel_diff", "grad rel. diff"), ("error", "error")],
                  title=f"served head request, H={h}, V={v}, {dev} (matmul peak {out['peak']['tflops']:.1f} TFLOP/s)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
