#!/usr/bin/env python3
"""The packed, compiled target capture on short rows: the row rule of the trainer against no padding.

On 2x H200 (2026-11-30) jobs on the builtin corpus (short dialogues: a 4-sample message can be under 128 tokens) died in the
target's first capture with an inductor error in the compiled flex kernel, whose block mask had one 128-token
block (dynamic shapes specialise a size of 1). The trainer now pads such rows to 256 tokens
(``target.packed_row_tokens``). This script runs the same message sequence (short rows first, then long ones)
through ``FeatureCapture(packing=True, compile=True)`` in a fresh process per rule:

* ``trainer``: the trainer's rule (``packed_row_tokens``);
* ``unpadded``: the rule before the fix on CUDA (the row is the samples, however short).

For each message: ok or the error (type and first lines), seconds, and the largest difference from the padded,
uncompiled capture of the same samples (the reference path). Prints a table, writes JSON.

    python bench/experiments/packed_short_rows.py --out short_rows.json      # CUDA
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _common
import _common as C  # noqa: E402
import torch  # noqa: E402

# token counts of the samples of each message: the first ones as short as the builtin corpus's messages
MESSAGES = [[30, 25, 40], [18, 22], [300, 200], [60, 41, 17, 9], [1500, 900, 400], [12]]


def run_rule(rule: str, target: str) -> dict:
    import dflash_dist.targets.hf as H
    import dflash_dist.roles.target_rank.capture as T
    from dflash_dist.config import default_layer_ids
    if rule == "unpadded":
        T.packed_row_tokens = lambda total, device_type: total  # the CUDA rule before the fix
    dev = C.pick_device("auto")
    tcfg = C.target_config(target)
    model, _, _ = C.build_target_on_device(tcfg, dev)
    tc = H.text_config(model.config)
    layer_ids = tcfg.layer_ids or default_layer_ids(tc.num_hidden_layers, tcfg.num_feature_layers)
    g = torch.Generator().manual_seed(0)
    rows = []
    for i, lens in enumerate(MESSAGES):
        lengths = torch.tensor(lens)
        seqs = [torch.randint(0, tc.vocab_size, (n,), generator=g) for n in lens]
        padded = torch.zeros(len(lens), max(lens), dtype=torch.long)
        for j, s in enumerate(seqs):
            padded[j, :len(s)] = s
        ref_cap = T.FeatureCapture(model, layer_ids)
        ref = ref_cap(padded.to(dev), lengths)
        ref_cap.close()
        row = {"message": i, "tokens": sum(lens), "samples": len(lens),
               "row_tokens": T.packed_row_tokens(sum(lens), dev.type)}
        cap = T.FeatureCapture(model, layer_ids, packing=True, compile=True)
        t0 = time.perf_counter()
        try:
            feats = cap(torch.cat(seqs)[None].to(dev), lengths)
            C.sync(dev)
            row.update(ok=True, seconds=time.perf_counter() - t0,
                       max_abs_diff=float((feats.float() - ref.float()).abs().max()))
        except Exception as e:
            tb = traceback.format_exc()
            row.update(ok=False, seconds=time.perf_counter() - t0, error=C.short_error(e, 300),
                       error_text=tb[-4000:])
        finally:
            cap.close()
        C.log(f"{rule}: message {i} ({sum(lens)} tokens, row {row['row_tokens']}): "
              + (f"ok, {row['seconds']:.2f} s, max |diff| {row['max_abs_diff']:.3g}" if row["ok"]
                 else f"FAILED {row['error']}"))
        rows.append(row)
    return {"rule": rule, "env": C.env_info(dev), "target": target, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="qwen3_0p6b_random")
    p.add_argument("--rules", default="trainer,unpadded")
    p.add_argument("--timeout", type=float, default=240, help="seconds per rule (its own process)")
    p.add_argument("--out", default=None)
    p.add_argument("--_rule", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._rule:
        print("RESULT " + json.dumps(run_rule(args._rule, args.target)), flush=True)
        return 0
    res = {"bench": "packed_short_rows", "messages": MESSAGES, "runs": []}
    for rule in args.rules.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--target", args.target, "--_rule", rule]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            out, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out, rc = f"{e.stdout or ''}{e.stderr or ''}", "timeout"
            out = out.decode() if isinstance(out, bytes) else out
        found = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
        run = found[0] if found else {"rule": rule, "rows": [], "log_tail": out[-4000:]}
        run["returncode"] = rc
        res["runs"].append(run)
        C.write_json(args.out, res)
    table_rows = [dict(rule=r["rule"], **row) for r in res["runs"] for row in r["rows"]]
    print(C.table(table_rows, [("rule", "rule"), ("message", "msg"), ("tokens", "tokens"),
                               ("row_tokens", "row"), ("ok", "ok"), ("seconds", "s"),
                               ("max_abs_diff", "max |diff| vs padded"), ("error", "error")],
                  title=f"packed compiled capture on short rows ({args.target})"))
    for r in res["runs"]:
        if not r["rows"]:
            print(f"{r['rule']}: no result (exit {r['returncode']}):\n{r.get('log_tail', '')[-1500:]}")
    C.write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
