#!/usr/bin/env python3
"""Target capture on shapes it has not seen: per-batch time and dynamo graph count, per capture path.

bench/target_capture.py times passes over batches its warm-up pass has already run, so a compile per new batch
shape stays out of its numbers. A real target rank meets a new packed length T (or padded [b, S]) with almost
every message. This script runs, per variant, --batches messages of the trainer's shape (--samples-per-batch
samples of uniform 275..825 tokens, random ids), every one new, and reports the time of each, the time of the last
half, and how many graphs dynamo compiled (``torch._dynamo.utils.counters``): a count that grows with the
batches means a recompile per shape.

    python bench/target_fresh_shapes.py --out fresh.json        # CUDA, Qwen3-8B-shaped random-init target
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from dflash_dist.config import default_layer_ids  # noqa: E402
from dflash_dist.target import FeatureCapture, text_config  # noqa: E402

VARIANTS = {"padded": (False, False), "padded_compiled": (False, True), "packed": (True, False),
            "packed_compiled": (True, True)}


def batches(n: int, per: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        lengths = torch.randint(275, 826, (per,), generator=g)
        yield lengths, [torch.randint(0, vocab, (int(x),), generator=g) for x in lengths]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="qwen3_8b_random")
    p.add_argument("--variants", default="packed_compiled,packed,padded_compiled,padded")
    p.add_argument("--batches", type=int, default=24)
    p.add_argument("--samples-per-batch", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dev = C.pick_device("auto")
    tcfg = C.target_config(args.target)
    model, how, build_s = C.build_target_on_device(tcfg, dev)
    tc = text_config(model.config)
    layer_ids = tcfg.layer_ids or default_layer_ids(tc.num_hidden_layers, tcfg.num_feature_layers)
    res = {"bench": "target_fresh_shapes", "env": C.env_info(dev), "target": args.target, "rows": []}
    for seed, name in enumerate(args.variants.split(",")):
        packing, compiled = VARIANTS[name]
        cap = FeatureCapture(model, layer_ids, packing=packing, compile=compiled)
        graphs0 = counters["stats"]["unique_graphs"]
        times, graphs, tokens = [], [], []
        for lengths, seqs in batches(args.batches, args.samples_per_batch, tc.vocab_size, seed=100 + seed):
            if packing:
                ids = torch.cat(seqs)[None].to(dev)
            else:
                ids = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long)
                for i, s in enumerate(seqs):
                    ids[i, :len(s)] = s
                ids = ids.to(dev)
            C.sync(dev)
            t0 = time.perf_counter()
            cap(ids, lengths)
            C.sync(dev)
            times.append(time.perf_counter() - t0)
            graphs.append(counters["stats"]["unique_graphs"] - graphs0)
            tokens.append(int(lengths.sum()))
        cap.close()
        half = len(times) // 2
        row = {"variant": name, "batch_s": times, "graphs_after_batch": graphs, "first_s": times[0],
               "last_half_tok_per_s": sum(tokens[half:]) / sum(times[half:]), "graphs": graphs[-1],
               "graphs_in_last_half": graphs[-1] - graphs[half - 1]}
        res["rows"].append(row)
        C.log(f"{name}: first {times[0]:.1f} s, last half {row['last_half_tok_per_s']:.0f} tok/s, graphs "
              f"{graphs[-1]} ({row['graphs_in_last_half']} in the last half); per batch: "
              + " ".join(f"{t:.2f}" for t in times))
        C.write_json(args.out, res)
    print()
    print(C.table(res["rows"], [("variant", "variant"), ("first_s", "1st batch s"),
                                ("last_half_tok_per_s", "tok/s (last half)"), ("graphs", "graphs compiled"),
                                ("graphs_in_last_half", "graphs in last half")],
                  title=f"target capture on new shapes ({args.batches} batches x {args.samples_per_batch} samples, "
                        f"{res['env'].get('gpu', dev.type)})"))
    C.write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
