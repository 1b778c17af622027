#!/usr/bin/env python3
"""Where the time of one verify step of the in-training evaluation goes.

On 2x H200 (torch 2.11, 2026-11-30) the in-training evaluation measured 65 ms per verify step run whole and 97 ms in slices on the Qwen3-8B-shaped target (257 steps
for 8 prompts x 32 tokens), where a 16-token forward of that target should take a few ms. This script runs the
evaluation's own code (``spec_decode.speculative_steps`` with the evaluator's drafter: fp32 as ``TargetEval``
builds it, and bf16) on random prompts and times, per drafter dtype, the median of: a whole slice, the target's
verify forward alone (``TargetRunner``, 16 tokens on a KV cache), the draft step alone (``make_dflash_draft_fn``).

    python bench/experiments/eval_step.py --out eval_step.json                      # CUDA, 8B-shaped random-init target
    python bench/experiments/eval_step.py --target tiny --drafter tiny --out /tmp/es.json   # CPU smoke
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _common
import _common as C  # noqa: E402
import torch  # noqa: E402

from dflash_dist.config import default_layer_ids  # noqa: E402
from dflash_dist.eval.spec_decode import make_dflash_draft_fn, speculative_steps
from dflash_dist.eval.target_runner import TargetRunner, new_cache
from dflash_dist.targets.hf import head_weights, text_config  # noqa: E402
from dflash_dist.model.spec import resolve_drafter  # noqa: E402


def timed(fn, dev) -> float:
    return C.wall_s(fn, dev) * 1e3


@torch.inference_mode()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="qwen3_8b_random")
    p.add_argument("--drafter", default="dflash")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=20, help="timings of each component alone")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dev = C.pick_device("auto")
    tcfg, dcfg = C.target_config(args.target), C.drafter_config(args.drafter)
    model, _, _ = C.build_target_on_device(tcfg, dev)
    tc = text_config(model.config)
    layer_ids = tcfg.layer_ids or default_layer_ids(tc.num_hidden_layers, tcfg.num_feature_layers)
    B = dcfg.block_size
    spec = resolve_drafter(dcfg, tc, len(layer_ids), dev.type)  # the drafter the job would build
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, tc.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.prompts)]
    embed, head = head_weights(model)
    res = {"bench": "eval_step", "env": C.env_info(dev), "target": args.target, "drafter": args.drafter,
           "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "rows": []}
    for dtype in (torch.float32, torch.bfloat16):
        drafter = spec.build_model("sdpa").to(dev, dtype).eval()
        slices = []
        for prompt in prompts:
            gen = speculative_steps(model, drafter, None, None, prompt, layer_ids, 3, B, args.new_tokens, [])
            while True:
                C.sync(dev)
                t0 = time.perf_counter()
                try:
                    next(gen)
                except StopIteration:
                    break
                C.sync(dev)
                slices.append((time.perf_counter() - t0) * 1e3)
        # the components alone, on the first prompt's prefill
        runner = TargetRunner(model, layer_ids)
        draft = make_dflash_draft_fn(drafter, embed, head)
        ids = torch.tensor([prompts[0]], device=dev)
        block = torch.full((1, B), 3, dtype=torch.long, device=dev)
        with runner.attached():
            cache = new_cache(model)
            _, ctx = runner(ids, 0, cache, keep=1)
            n = ids.shape[1]

            def verify():
                runner(block, n, cache, keep=B)
                from dflash_dist.eval.target_runner import crop_cache
                crop_cache(cache, n)
            verify_ms = [timed(verify, dev) for _ in range(args.repeats)]
        draft_ms = [timed(lambda: draft(ctx, block, n), dev) for _ in range(args.repeats)]
        row = {"drafter_dtype": str(dtype).replace("torch.", ""), "slices": len(slices),
               "slice_ms_median": C.median(slices[1:]) if len(slices) > 1 else None,
               "verify_ms_median": C.median(verify_ms[2:]), "draft_ms_median": C.median(draft_ms[2:])}
        res["rows"].append(row)
        C.log(f"drafter {row['drafter_dtype']}: slice {row['slice_ms_median']:.1f} ms, target verify "
              f"{row['verify_ms_median']:.1f} ms, draft {row['draft_ms_median']:.1f} ms")
        C.write_json(args.out, res)
        del drafter
    print(C.table(res["rows"], [("drafter_dtype", "evaluator drafter"), ("slices", "verify steps"),
                                ("slice_ms_median", "slice ms"), ("verify_ms_median", "target verify ms"),
                                ("draft_ms_median", "draft ms")],
                  title=f"one verify step of the evaluation ({args.target}, {res['env'].get('gpu', dev.type)})"))
    C.write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
