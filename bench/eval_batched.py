"""dflash-eval's speculative decoding one prompt at a time against several at once (``--batch-size``): tokens/s of
the speculative path and whether every prompt got the same acceptance lengths, one ``dflash-eval`` per batch size
on the same export, prompts and target.

    python bench/eval_batched.py --export EXPORT --prompts PROMPTS.jsonl --num-prompts 16 --max-new-tokens 128 \\
        --batch-sizes 1,4,16 --out OUT

Writes ``OUT/eval_batched.json`` and prints a table; each run's log and JSON are in ``OUT``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_eval(args, batch: int) -> dict:
    out = os.path.join(args.out, f"eval_b{batch}.json")
    cmd = [sys.executable, "-m", "dflash_dist.cli.eval", "--export", args.export, "--prompts", args.prompts,
           "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
           "--no-lossless-check", "--batch-size", str(batch), "--device", args.device, "--out", out] + args.extra
    t0 = time.monotonic()
    with open(os.path.join(args.out, f"eval_b{batch}.log"), "w") as log:
        rc = subprocess.call(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"dflash-eval --batch-size {batch} failed ({rc}): {args.out}/eval_b{batch}.log")
    res = json.load(open(out))
    return {"batch_size": batch, "tokens_per_s": res["tokens_per_s"], "decode_s": res["wall_s"],
            "process_s": round(time.monotonic() - t0, 1), "acceptance_length": res["acceptance_length"],
            "tau": res["tau"], "lengths": [r["acceptance_lengths"] for r in res["per_prompt"]],
            "device": res.get("device"), "target_dtype": res.get("target_dtype")}


def against_smallest(rows: list) -> dict:
    """Each row's ``speedup`` and ``prompts_same_lengths`` against the row of the smallest batch size (batch 1 where
    it was run), whatever order the batch sizes were given in; returns that row."""
    base = min(rows, key=lambda r: r["batch_size"])
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["prompts_same_lengths"] = sum(a == b for a, b in zip(r["lengths"], base["lengths"]))
    return base


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", required=True)
    ap.add_argument("--prompts", required=True, help="JSONL of {messages} or {prompt} rows")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--extra", default="", help="more dflash-eval arguments (space separated)")
    ap.add_argument("--out", default="/tmp/eval_batched")
    args = ap.parse_args()
    args.extra = args.extra.split()
    os.makedirs(args.out, exist_ok=True)
    rows = [run_eval(args, int(b)) for b in args.batch_sizes.split(",")]
    base = against_smallest(rows)
    import torch
    import transformers
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "cpus": os.cpu_count()}
    with open(os.path.join(args.out, "eval_batched.json"), "w") as f:
        json.dump({"environment": env, "args": {k: v for k, v in vars(args).items()}, "rows": rows}, f, indent=1)
    print(f"{args.num_prompts} prompts x {args.max_new_tokens} new tokens, {base['device']}, {base['target_dtype']}")
    b = base["batch_size"]
    print(f"| batch | tokens/s | x batch {b} | decode s | acceptance length | prompts with batch {b}'s lengths |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['batch_size']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | {r['decode_s']:.1f} | "
              f"{r['acceptance_length']:.3f} | {r['prompts_same_lengths']}/{len(r['lengths'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
