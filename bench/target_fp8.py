#!/usr/bin/env python3
"""FP8 target capture vs bf16, in one run on one model: tok/s of the packed + compiled capture (``FeatureCapture``,
as a target rank runs it) for each length mix, bf16 first, then the same model's decoder linears quantized on load
(``target.quantization=fp8``: ``targets.quant.quantize_linears``, float8 e4m3 weights per output channel, per-token
activation scales, ``torch._scaled_mm`` with fast accumulation; ``--exact-accum`` adds rows without it); the
per-layer cosine of the FP8 features against the bf16 ones (and of both against fp32) on a few samples; the
fast-path line (it names the FP8 GEMM kernel bound). MFU: bf16 rows against the bf16 peak, FP8 rows
against the FP8 peak (``flops.nominal_peak_tflops(fp8=True)``); the FLOPs are the same formula for both.

    python bench/target_fp8.py --out target_fp8.json                          # Qwen3-8B shape (random init)
    python bench/target_fp8.py --shape qwen3_30b_a3b --mixes 550 --out moe_fp8.json
    python bench/target_fp8.py --tiny --out /tmp/fp8.json                     # CPU smoke (reference kernel)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import target_capture as TC  # noqa: E402
import torch  # noqa: E402

from dflash_dist.config import default_layer_ids  # noqa: E402
from dflash_dist.data.batching import build_plan  # noqa: E402
from dflash_dist.data.synthetic import synthetic_dataset  # noqa: E402
from dflash_dist.targets.fast_path import check_target_fast_path  # noqa: E402
from dflash_dist.targets.hf import decoder_layers, text_config  # noqa: E402
from dflash_dist.targets.quant.compare import layer_cosines  # noqa: E402
from dflash_dist.targets.quant.fp8 import default_kernel  # noqa: E402
from dflash_dist.targets.quant.load import quantize_linears  # noqa: E402
from dflash_dist.roles.target_rank.batch import pad_batch  # noqa: E402
from dflash_dist.roles.target_rank.capture import FeatureCapture  # noqa: E402
from dflash_dist.telemetry.flops import nominal_peak_tflops  # noqa: E402


def batches_for(mix: str, budget: int, vocab: int, tokens: int, max_samples: int):
    source, _ = TC.mix_source(mix, tokens)
    ds = synthetic_dataset(source, vocab, 3072, seed=0)
    lengths = ds.lengths.tolist()
    plan = build_plan(lengths, range(len(ds)), epochs=1, seed=1234, max_batch_tokens=budget,
                      max_batch_samples=max_samples)
    return [[ds[i] for i in b] for b in plan], [(1, lengths[i]) for b in plan for i in b], sum(lengths)


@torch.inference_mode()
def features(model, layer_ids, samples, dev) -> torch.Tensor:
    """The capture's features of ``samples`` (padded rows, uncompiled: the reference path of both precisions)."""
    cap = FeatureCapture(model, layer_ids, packing=False, compile=False)
    try:
        ids, lens, _, _ = pad_batch(samples, dev, False)
        return cap(ids, lens).clone()
    finally:
        cap.close()


def measure_all(model, layer_ids, work, variants, dev, args, precision: str, tc, per_layer) -> list[dict]:
    rows = []
    peak = nominal_peak_tflops(dev, fp8=precision != "bf16")
    for (mix, budget), (inputs, runs, real) in work.items():
        for variant in variants:
            row = {"precision": precision, "mix": mix, "budget": budget, "variant": variant, "batches": len(inputs),
                   "real_tokens": real}
            try:
                row.update(TC.measure_variant(model, layer_ids, variant, inputs, dev, args))
                row["capture_tflops"] = TC.approx_flops(tc, per_layer, max(layer_ids) + 1, runs, False,
                                                        model) / row["capture_s"] / 1e12
                row["peak_tflops"] = peak
                if peak:
                    row["capture_mfu"] = row["capture_tflops"] / peak
                C.log(f"  {precision} {mix} {budget} {variant}: {row['capture_tokens_per_s']:,.0f} tok/s, "
                      f"{row['capture_tflops']:.0f} TFLOP/s, warm-up {row['warmup_s']:.1f} s")
            except Exception as e:
                row["error"] = C.short_error(e)
                C.log(f"  {precision} {mix} {variant} error: {row['error']}")
                C.free_memory(dev)
            rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized smoke run (packaged tiny target)")
    p.add_argument("--shape", default=None, choices=sorted(TC.SHAPES), help="a MoE model's shape, random init")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--mixes", default=None, help="length mixes, comma list (default 256-3072,550)")
    p.add_argument("--budgets", default=None, help="token budgets, comma list (default 16384)")
    p.add_argument("--variants", default=None, help="capture variants (default packed_compiled; --tiny: packed)")
    p.add_argument("--tokens-per-pass", type=int, default=None)
    p.add_argument("--max-batch-samples", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cos-samples", type=int, default=4, help="samples of the per-layer cosine")
    p.add_argument("--exact-accum", action="store_true",
                   help="also the FP8 rows without cuBLAS fast accumulation (FP8Linear.fast_accum=False)")
    args = p.parse_args(argv)
    dev = C.pick_device(args.device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    t0 = time.time()
    mixes = (args.mixes or ("64,32-160" if args.tiny else "256-3072,550")).split(",")
    budgets = [int(x) for x in (args.budgets or ("256" if args.tiny else "16384")).split(",")]
    variants = (args.variants or ("packed" if args.tiny else "packed_compiled")).split(",")
    tokens = args.tokens_per_pass or (1024 if args.tiny else 65536)
    if args.shape:
        tcfg = TC.shape_target_config(args.shape, args.tiny, dev.type, max(budgets))
        name = args.shape + (" (tiny)" if args.tiny else "")
    else:
        name = "tiny" if args.tiny else "qwen3_8b_random"
        tcfg = C.target_config(name)
    model, how, build_s = C.build_target_on_device(tcfg, dev)
    tc = text_config(model.config)
    layer_ids = tcfg.layer_ids or default_layer_ids(tc.num_hidden_layers, tcfg.num_feature_layers)
    per_layer = TC.layer_matmul_params(model)
    C.log(f"target {name}: {type(model).__name__}, built in {build_s:.1f} s ({how}); capture layers {layer_ids}")
    result = {"bench": "target_fp8", "env": C.env_info(dev), "target": name, "layer_ids": layer_ids,
              "variants": variants, "tokens_per_pass": tokens, "warmup_passes": args.warmup,
              "repeats": args.repeats, "rows": []}
    work = {(m, b): batches_for(m, b, tc.vocab_size, tokens, args.max_batch_samples) for m in mixes for b in budgets}
    cos_src = synthetic_dataset(f"synthetic:{64 if args.tiny else 1024}:{args.cos_samples}", tc.vocab_size, 3072,
                                seed=7)
    cos_samples = [cos_src[i] for i in range(len(cos_src))]
    ref = features(model, layer_ids, cos_samples, dev)
    # the bf16 target's own distance from fp32 weights and activations (buffers such as RoPE's stay as built): the
    # floor the FP8 cosine is read against on a random-init model
    built = {prm: prm.dtype for prm in model.parameters()}
    for prm in built:
        prm.data = prm.data.float()
    ref32 = features(model, layer_ids, cos_samples, dev)
    for prm, dtype in built.items():  # back exactly (bf16 -> fp32 -> bf16 is lossless)
        prm.data = prm.data.to(dtype)
    C.free_memory(dev)
    result["cosine_bf16_vs_fp32"] = layer_cosines(ref32, ref, len(layer_ids))
    C.log("per-layer cosine bf16 vs fp32: " + ", ".join(f"layer {i}: {c['mean']:.5f}"
                                                      for i, c in zip(layer_ids, result["cosine_bf16_vs_fp32"])))
    result["bf16_fast_path"] = check_target_fast_path(model, "allow", dev.type)["summary"]
    result["rows"] += measure_all(model, layer_ids, work, variants, dev, args, "bf16", tc, per_layer)
    C.write_json(args.out, result)

    torch._dynamo.reset()  # the FP8 layers compile afresh
    kernel = default_kernel(dev)
    t_q = time.time()
    result["quantization"] = quantize_linears(model, decoder_layers(model)[1], kernel)
    result["quantize_s"] = time.time() - t_q
    C.free_memory(dev)
    fp = check_target_fast_path(model, "require" if dev.type == "cuda" else "allow", dev.type)
    result["fp8_fast_path"] = fp["summary"]
    C.log(f"fast path (FP8): {fp['summary']}")
    fp8_feats = features(model, layer_ids, cos_samples, dev)
    result["cosine"] = layer_cosines(ref, fp8_feats, len(layer_ids))
    result["cosine_fp8_vs_fp32"] = layer_cosines(ref32, fp8_feats, len(layer_ids))
    C.log("per-layer cosine FP8 vs bf16: " + ", ".join(f"layer {i}: {c['mean']:.5f} (min {c['min']:.4f})"
                                                     for i, c in zip(layer_ids, result["cosine"])))
    C.log("per-layer cosine FP8 vs fp32: " + ", ".join(f"layer {i}: {c['mean']:.5f}"
                                                     for i, c in zip(layer_ids, result["cosine_fp8_vs_fp32"])))
    result["rows"] += measure_all(model, layer_ids, work, variants, dev, args, "fp8", tc, per_layer)
    if args.exact_accum and dev.type == "cuda":  # the same FP8 model without cuBLAS fast accumulation
        for m in model.modules():
            if hasattr(m, "fast_accum"):
                m.fast_accum = False
        torch._dynamo.reset()
        fa = features(model, layer_ids, cos_samples, dev)
        result["cosine_exact_accum"] = layer_cosines(ref, fa, len(layer_ids))
        C.log("per-layer cosine FP8 (exact accum) vs bf16: " + ", ".join(
            f"layer {i}: {c['mean']:.5f}" for i, c in zip(layer_ids, result["cosine_exact_accum"])))
        result["rows"] += measure_all(model, layer_ids, work, variants, dev, args, "fp8_exact_accum", tc, per_layer)
    base = {(r["mix"], r["budget"], r["variant"]): r for r in result["rows"] if r["precision"] == "bf16"}
    for r in result["rows"]:
        b = base.get((r["mix"], r["budget"], r["variant"]))
        if r["precision"] != "bf16" and b and "error" not in r and "error" not in b:
            r["speedup_vs_bf16"] = b["capture_s"] / r["capture_s"]
    result["wall_s"] = time.time() - t0
    C.write_json(args.out, result)
    cols = [("precision", "precision"), ("mix", "mix"), ("budget", "budget"), ("variant", "variant"),
            ("capture_tokens_per_s", "capture tok/s"), ("speedup_vs_bf16", "vs bf16"),
            ("capture_tflops", "TFLOP/s"), ("capture_mfu", "MFU"), ("capture_peak_mem_gb", "peak GB"),
            ("error", "error")]
    print()
    print(C.table(result["rows"], cols, title=f"target capture bf16 vs FP8 ({name}, {dev.type}; {fp['summary']})"))
    return 0 if all("error" not in r for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
