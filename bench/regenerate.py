#!/usr/bin/env python3
"""Regeneration throughput: ``dflash_dist.data.generation.regenerate_rows`` (the code dflash-regenerate runs) on N
prompts at several batch sizes, new tokens per second of one GPU.

    python bench/regenerate.py --prompts 256 --batch 16,256 --max-new-tokens 256 --out regen.json
    python bench/regenerate.py --tiny          # CPU smoke test of the harness (numbers mean nothing)

Target: the Qwen3-8B-shaped random-init target (``conf/target/qwen3_8b_random.yaml``, bf16), prompts: the first N
conversations of the built-in corpus (user turns), tokenized by the packaged tokenizer. Random weights rarely
emit an EOS id, so nearly every row runs to ``--max-new-tokens`` (the JSON says how many did): a fair, fixed
amount of work per batch size, not the length mix of a real model. Batch 16 was dflash-regenerate's default
before the CUDA default became 256. Each batch size is run once after one untimed warm-up batch; the device is
synchronised around each run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

from dflash_dist.cli.regenerate import prepare_row  # noqa: E402
from dflash_dist.data.conversations import builtin_conversations  # noqa: E402
from dflash_dist.data.generation import regenerate_rows  # noqa: E402
from dflash_dist.eval.prompts import eos_token_ids  # noqa: E402
from dflash_dist.targets.hf import TINY_DIR  # noqa: E402


def prompt_items(n: int) -> list:
    items = []
    for conv in builtin_conversations():
        row, msgs, original, _ = prepare_row(conv)
        if row is not None:
            items.append((len(items), row, msgs, original))
        if len(items) == n:
            break
    return items


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--batch", default="16,256", help="comma-separated batch sizes")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--target", default="qwen3_8b_random", help="a conf/target preset")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny target, few prompts and tokens")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.prompts, args.batch, args.max_new_tokens, args.target = 8, "2,8", 4, "tiny"
    device = C.pick_device("cpu" if args.tiny else args.device)
    from transformers import AutoTokenizer
    tcfg = C.target_config(args.target)
    model, how, build_s = C.build_target_on_device(tcfg, device)
    model.to(device).eval()
    tok = AutoTokenizer.from_pretrained(tcfg.tokenizer or TINY_DIR)
    eos = eos_token_ids(tok, model.config)
    items = prompt_items(args.prompts)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=0.0, top_p=1.0, eos_ids=eos, on_empty="keep", seed=0)
    regenerate_rows(model, tok, items[:2], batch_size=2, **dict(kw, max_new_tokens=2))  # warm-up (kernels, cache)
    rows = []
    for b in [int(x) for x in args.batch.split(",")]:
        C.sync(device)
        t0 = time.perf_counter()
        out, counts = regenerate_rows(model, tok, items, batch_size=b, **kw)
        C.sync(device)
        wall = time.perf_counter() - t0
        rows.append({"batch": b, "prompts": len(items), "rows_out": len(out), "new_tokens": counts["new_tokens"],
                     "hit_max_new_tokens": counts["hit_max_new_tokens"], "wall_s": wall,
                     "tokens_per_s": counts["new_tokens"] / wall})
        C.log(f"batch {b}: {counts['new_tokens']} new tokens in {wall:.1f} s")
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup_vs_first"] = r["tokens_per_s"] / base
    print(C.table(rows, [("batch", "batch"), ("prompts", "prompts"), ("new_tokens", "new tokens"),
                         ("hit_max_new_tokens", "hit max"), ("wall_s", "wall s"), ("tokens_per_s", "tokens/s"),
                         ("speedup_vs_first", f"x batch {rows[0]['batch']}")],
                  title=f"regeneration, {args.target}, {args.max_new_tokens} new tokens max, {device}"))
    C.write_json(args.out, {"env": C.env_info(device), "target": args.target, "build": how, "build_s": build_s,
                            "max_new_tokens": args.max_new_tokens, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
