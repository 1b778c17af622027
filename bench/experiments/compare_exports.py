"""Export checkpoints with the code on PYTHONPATH and compare the result with an earlier export, file by file:
``config.json`` as parsed JSON and as bytes, every safetensors tensor (name, dtype, shape, bytes), and every other
file byte for byte. Used to show that a restructuring of the package changes no exported byte.

    python compare_exports.py export CKPT_DIR OUT_DIR [--dtype float32]
    python compare_exports.py compare BEFORE_DIR AFTER_DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys


def export(ckpt: str, out: str, dtype: str) -> int:
    from dflash_dist.cli.export import main
    return main([ckpt, out, "--dtype", dtype, "--overwrite"])


def _files(d: str) -> list:
    return sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs)


def compare(before: str, after: str) -> list:
    from safetensors import safe_open
    problems = []
    fb, fa = _files(before), _files(after)
    if fb != fa:
        problems.append(f"file lists differ: only before {sorted(set(fb) - set(fa))}, only after {sorted(set(fa) - set(fb))}")
    for rel in sorted(set(fb) & set(fa)):
        pb, pa = os.path.join(before, rel), os.path.join(after, rel)
        if rel.endswith(".safetensors"):
            with safe_open(pb, "pt") as b, safe_open(pa, "pt") as a:
                if sorted(b.keys()) != sorted(a.keys()):
                    problems.append(f"{rel}: tensor names differ")
                for k in sorted(set(b.keys()) & set(a.keys())):
                    tb, ta = b.get_tensor(k), a.get_tensor(k)
                    if tb.dtype != ta.dtype or tb.shape != ta.shape or \
                            tb.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes() != \
                            ta.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes():
                        problems.append(f"{rel}: tensor {k} differs")
                if b.metadata() != a.metadata():
                    problems.append(f"{rel}: header metadata differs")
        elif rel.endswith(".json"):
            if json.load(open(pb)) != json.load(open(pa)):
                problems.append(f"{rel}: JSON content differs")
        if open(pb, "rb").read() != open(pa, "rb").read():
            problems.append(f"{rel}: bytes differ")
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("checkpoint")
    e.add_argument("out")
    e.add_argument("--dtype", default="bfloat16")
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    args = p.parse_args(argv)
    if args.cmd == "export":
        return export(args.checkpoint, args.out, args.dtype)
    problems = compare(args.before, args.after)
    for f in _files(args.after):
        print(f"{hashlib.sha256(open(os.path.join(args.after, f), 'rb').read()).hexdigest()[:16]}  {f}")
    print("\n".join(problems) if problems else f"identical: {args.before} == {args.after}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
