#!/usr/bin/env python3
"""How often the target's own greedy next token equals the data's label, on the tokens a drafter is trained on:
where the two agree, ``drafter.loss.labels=target`` and the data's labels train the same thing. A data set of the
target's own replies (``dflash-regenerate``) should agree almost everywhere; human-written replies much less.

    python bench/label_agreement.py --model DIR --data regen=REGEN.jsonl --data original=SHAREGPT.jsonl \\
        --rows 48 --out OUT.json

For each ``--data`` (``label=path``, a file ``data=jsonl`` reads): the first ``--rows`` usable conversations,
tokenized as training tokenizes them (chat template, assistant-only loss mask, ``--max-length``), one target
forward each; at every position whose next token carries a loss, the target's argmax against that token.
Prints a table; writes the JSON when ``--out`` is given."""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_dist.data.conversations import BadDataStats
from dflash_dist.data.sources import read_conversations
from dflash_dist.data.tokenize import tokenize_conversation


def row_agreement(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> tuple[int, int]:
    """(agreeing, supervised) over one row: logits [L, V] at positions 0..L-1 predict ids 1..L-1; a position
    counts where the token it predicts carries a loss (``mask[t + 1]``)."""
    pred = logits[:-1].argmax(-1)
    sel = mask[1:].bool()
    return int((pred == ids[1:])[sel].sum()), int(sel.sum())


def summarize(per_row: list[tuple[int, int]]) -> dict:
    """Pooled agreement (every supervised token alike), the mean over rows and its standard error."""
    rows = [(a, n) for a, n in per_row if n > 0]
    agree, total = sum(a for a, _ in rows), sum(n for _, n in rows)
    fr = [a / n for a, n in rows]
    mean = sum(fr) / len(fr) if fr else float("nan")
    var = sum((x - mean) ** 2 for x in fr) / (len(fr) - 1) if len(fr) > 1 else float("nan")
    return {"rows": len(rows), "tokens": total, "pooled": agree / total if total else float("nan"),
            "row_mean": mean, "row_mean_stderr": math.sqrt(var / len(fr)) if len(fr) > 1 else float("nan")}


@torch.no_grad()
def measure(model, tokenizer, path: str, rows: int, max_length: int, device: str) -> dict:
    convs = read_conversations(path, BadDataStats())
    per_row, skipped = [], 0
    for conv in convs:
        if len(per_row) == rows:
            break
        r = tokenize_conversation(tokenizer, conv, max_length, "truncate", model.config.vocab_size)
        if isinstance(r, str):
            skipped += 1
            continue
        ids, mask = torch.tensor(r[0], device=device), torch.tensor(r[1], device=device)
        logits = model(ids[None]).logits[0]
        per_row.append(row_agreement(logits, ids, mask))
    return {**summarize(per_row), "skipped": skipped, "path": path}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the target's HF directory (model and tokenizer)")
    ap.add_argument("--data", action="append", required=True, help="label=path of a JSONL of conversations")
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    res = {"model": args.model, "dtype": args.dtype, "device": args.device, "max_length": args.max_length,
           "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "python": platform.python_version(),
                           "date": time.strftime("%Y-%m-%d"),
                           "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None},
           "sets": {}}
    print("| data | rows | tokens | target argmax = label (pooled) | row mean +- stderr | s |")
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    for item in args.data:
        label, _, path = item.partition("=")
        if not path:
            ap.error(f"--data {item!r}: use label=path")
        t0 = time.monotonic()
        r = measure(model, tokenizer, path, args.rows, args.max_length, args.device)
        r["seconds"] = round(time.monotonic() - t0, 1)
        res["sets"][label] = r
        print(f"| {label} | {r['rows']} | {r['tokens']} | {r['pooled']:.4f} | {r['row_mean']:.4f} +- "
              f"{r['row_mean_stderr']:.4f} | {r['seconds']} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
