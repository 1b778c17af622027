#!/usr/bin/env python3
"""Recompute the FLOPs, TFLOP/s and MFU of a drafter_step JSON with the current formula (dflash_dist.telemetry.flops).

Timings are untouched; every row's FLOPs are rebuilt from what the row recorded (batch, S_pad, anchors, mean
visible pairs). Used once to correct results measured before the attention term counted every drafter layer
(it counted one): ``python bench/refresh_flops.py docs/results/.../drafter_step_*.json`` (rewrites in place).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash_dist.model.drafter import DrafterModelConfig  # noqa: E402
from dflash_dist.telemetry.flops import drafter_step_flops  # noqa: E402


def refresh(path: str) -> int:
    with open(path) as f:
        d = json.load(f)
    mc = DrafterModelConfig(**d["drafter_config"])
    peak, nominal = d["peak_matmul"]["tflops"], d.get("nominal_peak_tflops")
    recompute = d.get("loss_mode", "checkpoint") == "checkpoint"   # results before the fused loss: checkpoint
    n = 0
    for r in d["rows"]:
        if "error" in r or "flops" not in r:
            continue
        rec = recompute or r["backend"].endswith("+ckpt_loss")
        fl = drafter_step_flops(mc, r["batch"], r["s_pad"], r["anchors"], mc.vocab_size, r["flops"]["visible_pairs"],
                                r["mode"] == "train", recompute_head=rec)
        sec = r["ms_per_step"] / 1e3
        r["flops"].update(fl)
        r["tflops_model"], r["tflops_hw"] = fl["model"] / sec / 1e12, fl["hardware"] / sec / 1e12
        r["mfu_measured_peak"] = r["tflops_model"] / peak
        r["hfu_measured_peak"] = r["tflops_hw"] / peak
        r["mfu_nominal_peak"] = r["tflops_model"] / nominal if nominal else None
        for key in ("mfu_measured_peak", "hfu_measured_peak", "mfu_nominal_peak"):
            r[key.replace("peak", "pct")] = None if r[key] is None else 100 * r[key]
        r["attention_flop_share"] = fl["attention"] / fl["model"]
        n += 1
    d["flops_refreshed"] = "dflash_dist.telemetry.flops (attention x num_layers)"
    with open(path, "w") as f:
        json.dump(d, f, indent=1)
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="+")
    args = p.parse_args(argv)
    for path in args.paths:
        print(f"{path}: {refresh(path)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
