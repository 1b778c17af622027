#!/usr/bin/env python3
"""Target capture on shapes it has not seen: per-batch time and dynamo graph count, per capture path.

bench/target_capture.py times passes over batches its warm-up pass has already run, so a compile per new batch
shape stays out of its numbers. A real target rank meets a new packed length T (or padded [b, S]) with almost
every message. This script runs, per variant, --batches messages of the trainer's shape (--samples-per-batch
samples of uniform 275..825 tokens, random ids), every one new, and reports the time of each, the time of the last
half, and how many graphs dynamo compiled (``torch._dynamo.utils.counters``): a count that grows with the
batches means a recompile per shape. ``--repeat``: then the same batches again (every shape seen once), so the
cost of a new shape is the difference of the two passes' medians. Padded variants run once per
``--pad-multiples`` value (``target.tuning.pad_multiple``: rows rounded up to that multiple). ``--profile``: the CPU
ops of one batch of a new shape next to one of a seen shape (torch.profiler, top ops by self CPU time).

    python bench/target_fresh_shapes.py --out fresh.json        # CUDA, Qwen3-8B-shaped random-init target
    python bench/target_fresh_shapes.py --target qwen3_next_small --variants padded --pad-multiples 1,64 \
        --repeat --profile --out fresh_hybrid.json              # the hybrid target (fla, causal-conv1d)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from dflash_dist.config import default_layer_ids  # noqa: E402
from dflash_dist.targets.hf import text_config  # noqa: E402
from dflash_dist.roles.target_rank.capture import FeatureCapture  # noqa: E402

VARIANTS = {"padded": (False, False), "padded_compiled": (False, True), "packed": (True, False),
            "packed_compiled": (True, True)}


def batches(n: int, per: int, vocab: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(275, 826, (per,), generator=g)
        out.append((lengths, [torch.randint(0, vocab, (int(x),), generator=g) for x in lengths]))
    return out


def as_input(seqs, lengths, packing: bool, dev):
    if packing:
        return torch.cat(seqs)[None].to(dev)
    ids = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
    return ids.to(dev)


def timed(cap, ids, lengths, dev) -> float:
    return C.wall_s(lambda: cap(ids, lengths), dev)


def top_ops(cap, ids, lengths, dev, n: int = 12) -> list:
    """Ops of one capture by self CPU time (ms), most first."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        timed(cap, ids, lengths, dev)
    ev = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return [{"op": e.key[:90], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in ev]


def run_variant(name, packing, compiled, pad, model, layer_ids, data, args, dev) -> dict:
    cap = FeatureCapture(model, layer_ids, packing=packing, compile=compiled, pad_multiple=pad)
    graphs0 = counters["stats"]["unique_graphs"]
    times, graphs, tokens = [], [], []
    for lengths, seqs in data:
        times.append(timed(cap, as_input(seqs, lengths, packing, dev), lengths, dev))
        graphs.append(counters["stats"]["unique_graphs"] - graphs0)
        tokens.append(int(lengths.sum()))
    half = len(times) // 2
    row = {"variant": name, "pad_multiple": pad, "capture": cap.describe(), "batch_s": times, "first_s": times[0],
           "graphs_after_batch": graphs, "median_new_s": statistics.median(times[1:] or times),
           "last_half_tok_per_s": sum(tokens[half:]) / sum(times[half:]), "graphs": graphs[-1],
           "graphs_in_last_half": graphs[-1] - graphs[half - 1]}
    if args.repeat:  # the same shapes again: nothing new to build, compile or tune
        again = [timed(cap, as_input(seqs, lengths, packing, dev), lengths, dev) for lengths, seqs in data]
        row.update({"repeat_batch_s": again, "median_seen_s": statistics.median(again),
                    "new_shape_cost_s": row["median_new_s"] - statistics.median(again)})
    if args.profile:
        fresh = batches(1, args.samples_per_batch, text_config(model.config).vocab_size, seed=999)[0]
        lengths, seqs = fresh
        row["profile_new"] = top_ops(cap, as_input(seqs, lengths, packing, dev), lengths, dev)
        row["profile_seen"] = top_ops(cap, as_input(seqs, lengths, packing, dev), lengths, dev)
        for which in ("new", "seen"):
            C.log(f"{name} pad {pad}, {which} shape, top ops by self CPU ms: " + "; ".join(
                f"{o['op']} x{o['calls']} {o['self_cpu_ms']:.1f}" for o in row[f"profile_{which}"][:8]))
    cap.close()
    C.log(f"{name} (pad {pad}): first {times[0]:.2f} s, median new {row['median_new_s'] * 1e3:.1f} ms"
          + (f", seen {row['median_seen_s'] * 1e3:.1f} ms" if args.repeat else "")
          + f", graphs {graphs[-1]} ({row['graphs_in_last_half']} in the last half)")
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="qwen3_8b_random", help="conf/target group")
    p.add_argument("--variants", default="packed_compiled,packed,padded_compiled,padded")
    p.add_argument("--pad-multiples", default="1", help="padded variants: target.tuning.pad_multiple values, comma list")
    p.add_argument("--batches", type=int, default=24)
    p.add_argument("--samples-per-batch", type=int, default=4)
    p.add_argument("--repeat", action="store_true", help="a second pass over the same shapes")
    p.add_argument("--profile", action="store_true", help="top CPU ops of a new shape vs a seen one")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dev = C.pick_device("auto")
    tcfg = C.target_config(args.target)
    model, how, build_s = C.build_target_on_device(tcfg, dev)
    tc = text_config(model.config)
    layer_ids = tcfg.layer_ids or default_layer_ids(tc.num_hidden_layers, tcfg.num_feature_layers)
    res = {"bench": "target_fresh_shapes", "env": C.env_info(dev), "target": args.target, "rows": []}
    if any(k in args.target for k in ("next", "hybrid")):
        from dflash_dist.targets.fast_path import check_target_fast_path
        res["fast_path"] = check_target_fast_path(model, tcfg.fast_path, dev.type)["summary"]
        C.log(f"target kernels: {res['fast_path']}")
    for seed, name in enumerate(args.variants.split(",")):
        packing, compiled = VARIANTS[name]
        data = batches(args.batches, args.samples_per_batch, tc.vocab_size, seed=100 + seed)
        for pad in ([1] if packing else [int(x) for x in args.pad_multiples.split(",")]):
            res["rows"].append(run_variant(name, packing, compiled, pad, model, layer_ids, data, args, dev))
            C.write_json(args.out, res)
    print()
    cols = [("variant", "variant"), ("pad_multiple", "pad multiple"), ("first_s", "1st batch s"),
            ("median_new_s", "median s, new shapes"), ("last_half_tok_per_s", "tok/s (last half)"),
            ("graphs", "graphs compiled"), ("graphs_in_last_half", "graphs in last half")]
    if args.repeat:
        cols[4:4] = [("median_seen_s", "median s, seen shapes"), ("new_shape_cost_s", "cost of a new shape, s")]
    print(C.table(res["rows"], cols, title=f"target capture on new shapes ({args.target}, {args.batches} batches x "
                                           f"{args.samples_per_batch} samples, {res['env'].get('gpu', dev.type)})"))
    C.write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
