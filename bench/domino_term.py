#!/usr/bin/env python3
"""Domino's loss term, forward + backward: what training runs against the checkpointed autograd reference.

The term is ``(1 - lambda) * sum w (CE(corrected) - CE(base))`` over a step's loss rows, corrected = base +
the correction's projection onto the vocabulary (model/variants/domino/). Three ways, same rows and weights:

* ``term``: ``domino.variant.mixed_term`` as training runs it (the gradients computed chunk by chunk in the
  forward: one pass over the vocabulary);
* ``reference``: the same term with each chunk's two CEs (``domino.head._chunk``) recomputed in the backward
  by torch's checkpoint, as training ran it before;
* ``objective``: the decayed CE of the same rows (``loss.weighted_ce``'s fused path), the pass every variant pays.

Also the relative difference of the term's gradients (rows, correction features, projection) from the
reference's. ms per forward + backward (median), peak device memory on CUDA; lambda 0 (the second half of a run).

    python bench/domino_term.py --out domino_term.json                           # CUDA, SmolLM2-135M's shape
    python bench/domino_term.py --device cpu --rows 960 --out /tmp/dt.json        # CPU
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import torch  # noqa: E402

from dflash_dist.model import loss as L  # noqa: E402
from dflash_dist.model.variants.domino import head as D  # noqa: E402
from dflash_dist.model.variants.domino.variant import mixed_term  # noqa: E402

SHAPES = {"smollm2-135m": (576, 49152), "qwen3-8b": (4096, 151936), "tiny": (32, 512)}


def inputs(rows: int, hidden: int, vocab: int, emb: int, block: int, device, dtype, seed: int = 0) -> dict:
    """Loss rows of whole blocks (slots 1..B-1; slot 1 uncorrected), a frozen head, a trainable projection."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows -= rows % (block - 1)
    slot = torch.arange(rows) % (block - 1) + 1
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[torch.rand(rows, generator=g) < 0.1] = L.IGNORE_INDEX
    t = {"h": torch.randn(rows, hidden, generator=g) * 0.5, "e": torch.randn(rows, emb, generator=g),
         "head": torch.randn(vocab, hidden, generator=g) * hidden ** -0.5,
         "proj": torch.randn(vocab, emb, generator=g) * 0.02}
    t = {k: v.to(device, dtype) for k, v in t.items()}
    for k in ("h", "e", "proj"):
        t[k].requires_grad_(True)
    w = L.slot_weights(block, 7.0)[slot] * (labels >= 0)
    t.update(corrected=(slot >= 2).to(device), labels=labels.to(device), w=w.to(device))
    return t


def run_term(t: dict, lam: float, chunk: int):
    term, _, _ = mixed_term(t["h"], t["e"], t["corrected"], t["head"], t["proj"], t["labels"], t["w"], lam, chunk)
    return term


def run_reference(t: dict, lam: float, chunk: int):
    """The same term, each chunk of ``domino.head._chunk`` (both CEs) recomputed in the backward by checkpoint."""
    from torch.utils.checkpoint import checkpoint
    term = t["h"].new_zeros((), dtype=torch.float32)
    for lo in range(0, t["labels"].numel(), chunk):
        sl = slice(lo, lo + chunk)
        f, b, _, _ = checkpoint(D._chunk, t["h"][sl], t["e"][sl], t["corrected"][sl], t["head"], t["proj"],
                                t["labels"][sl], t["w"][sl], use_reentrant=False)
        term = term + (1.0 - lam) * (f - b)
    return term


def run_objective(t: dict, chunk: int):
    """The objective's pass over the same rows: the frozen head's fused weighted CE (``loss.frozen_head_ce``)."""
    return L._FrozenHeadCE.apply(t["h"], t["head"], t["labels"], t["w"], chunk, False, 0)[0]


def grads(fn, t: dict) -> list:
    for k in ("h", "e", "proj"):
        t[k].grad = None
    fn().backward()
    return [t[k].grad.detach().clone() for k in ("h", "e", "proj")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--shape", default="smollm2-135m", choices=list(SHAPES), help="target hidden size and vocabulary")
    ap.add_argument("--rows", type=int, default=7680, help="loss rows (a step of 512 blocks of 16: 7,680)")
    ap.add_argument("--emb", type=int, default=256, help="drafter.domino.emb_dim")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=4096, help="drafter.tuning.loss_chunk_rows")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="auto: bfloat16 on CUDA (as training), float32 on CPU")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    device = C.pick_device(args.device)
    dtype = (getattr(torch, args.dtype) if args.dtype != "auto"
             else torch.bfloat16 if device.type == "cuda" else torch.float32)
    hidden, vocab = SHAPES[args.shape]
    t = inputs(args.rows, hidden, vocab, args.emb, args.block, device, dtype)
    # lambda 0 (the second half of a run by default): term and reference are the same loss
    g_term, g_ref = grads(lambda: run_term(t, 0.0, args.chunk), t), grads(lambda: run_reference(t, 0.0, args.chunk), t)
    rel = [float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)) for a, b in zip(g_term, g_ref)]
    results = []
    for name, fn in (("objective", lambda: run_objective(t, args.chunk)),
                     ("term", lambda: run_term(t, 0.0, args.chunk)),
                     ("reference", lambda: run_reference(t, 0.0, args.chunk))):
        C.free_memory(device)
        C.reset_peak(device)
        times = C.time_repeats(lambda: fn().backward(), device, args.warmup, args.repeats)
        results.append({"path": name, "ms": C.median(times) * 1e3, **C.mem_gb(device)})
    ref_ms = results[2]["ms"]
    for r in results:
        r["x_reference"] = ref_ms / r["ms"]
    print(C.table(results, [("path", "path"), ("ms", "ms fwd+bwd"), ("x_reference", "x reference (speed)"),
                            ("peak_gb", "peak GiB")],
                  title=f"Domino term, {args.shape} ({hidden} x {vocab}), {t['labels'].numel()} rows, "
                        f"emb {args.emb}, chunk {args.chunk}, {dtype}, {device}"))
    print(f"gradient relative difference term vs reference (rows, features, projection): "
          f"{', '.join(f'{x:.2e}' for x in rel)}")
    C.write_json(args.out, {"env": C.env_info(device), "args": vars(args), "results": results,
                            "grad_rel_diff": dict(zip(("rows", "features", "projection"), rel))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
