#!/usr/bin/env python3
"""Target supply: tokens/s of the feature capture (``FeatureCapture``: hooks copy the 5 layers, the forward stops
after the last one, no lm_head) vs the full HF forward (all layers, lm_head, ``output_hidden_states=True``).

Variants (``--variants``, all measured on the same batches with the same warm-up and repeats; each row says its
``variant`` and its speed relative to ``padded``): ``padded`` = right-padded rows through the model's sdpa (the
path of ``target.packing=off``), ``packed`` = the batch as one row, no padding, document-causal compiled flex
attention (``target.packing=on``), ``*_compiled`` = the same with the decoder layers compiled
(``target.compile=true``). The full forward is timed once per (mix, budget), padded, next to the padded row.

Dense mode (default): the Qwen3-8B-shaped random-init bf16 target of ``conf/target/qwen3_8b_random.yaml`` (36
layers, hidden 4096), built by ``dflash_dist.targets.hf.build_target_model`` (random init on the device), capture
layers ``[1, 9, 17, 25, 33]``. Samples come from ``dflash_dist.data.synthetic`` (random ids; length mixes "550" =
uniform 275..825 and "256-3072" = uniform 256..3072) and are batched by ``dflash_dist.data.batching.build_plan`` under a
token budget (``n * max_len <= budget``), padded by ``target_loop.pad_batch``: exactly what a target rank runs.
The timed region per batch is what the target rank counts as busy: pad_batch + forward + synchronize. Warm-up
passes (untimed, ``warmup_s``) run every batch, so compiled variants compile every shape before timing.

Hybrid mode (``--hybrid``): a reduced Qwen3-Next-shaped target (12 layers [linear, linear, linear, full] x 3,
hidden 2048, GatedDeltaNet layers with 16 key / 32 value heads of dim 128, dense MLPs unless --hybrid-experts),
with the kernels transformers bound reported by ``fast_path.check_target_fast_path(model, 'allow', ...)``. Run it
once with and once without causal-conv1d importable to get the fast-path ratio (bench/run_gpu.sh does).

    python bench/target_capture.py --out target_capture.json
    python bench/target_capture.py --hybrid --out hybrid.json
    python bench/target_capture.py --variants padded,packed_compiled --out tc.json
    python bench/target_capture.py --tiny --out /tmp/tc.json          # CPU smoke (packaged tiny target)

Hybrid shape ``--shape qwen3_5_9b`` (Qwen3.5-9B's text model, random init): padded rows vs packed rows, whose
GatedDeltaNet layers take the samples' boundaries through fla's ``cu_seqlens`` and causal-conv1d's ``seq_idx``
(each row's ``capture_path`` says which ran; packing is refused without both kernels):

    python bench/target_capture.py --shape qwen3_5_9b --variants padded,packed --out q35.json

MoE shapes (``--shape``): random-init bf16 targets of a real MoE model's shape, the bound experts implementation
reported (``fast_path.experts_report``: grouped_mm / eager / grouped_mm->fallback_loop, what really runs) with
the fast-path summary (attention, SDPA backend), FLOPs counting active experts only (``flops.target_capture_flops``):

* ``qwen3_30b_a3b``: Qwen3-30B-A3B (48 layers, hidden 2048, 128 experts of 768, top-8, GQA 32/4 x 128);
* ``gpt_oss_20b``: gpt-oss-20b (24 layers, hidden 2880, 32 experts of 2880, top-4, 64/8 heads x 64, alternating
  sliding-128/full attention with sinks, YaRN). Padded rows run transformers' ``flex_attention`` on CUDA (sdpa is
  refused for gpt-oss: sinks), eager on CPU; packed rows the project's document-causal flex (window masks, sinks).

    python bench/target_capture.py --shape qwen3_30b_a3b --variants padded,packed_compiled --out moe.json
    python bench/target_capture.py --shape gpt_oss_20b --variants padded,packed_compiled --out gptoss.json
    python bench/target_capture.py --shape qwen3_30b_a3b --tiny --out /tmp/moe.json   # CPU smoke, tiny same family
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import torch  # noqa: E402

from dflash_dist.config import TargetConfig, default_layer_ids  # noqa: E402
from dflash_dist.data.batching import build_plan  # noqa: E402
from dflash_dist.data.synthetic import synthetic_dataset  # noqa: E402
from dflash_dist.targets.hf import text_config  # noqa: E402
from dflash_dist.roles.target_rank.batch import pad_batch  # noqa: E402
from dflash_dist.roles.target_rank.capture import FeatureCapture  # noqa: E402
from dflash_dist.roles.target_rank.packing import packed_stats  # noqa: E402
from dflash_dist.telemetry.flops import nominal_peak_tflops, target_forward_flops  # noqa: E402


def mix_source(mix: str, tokens: int) -> tuple[str, float]:
    """'550' -> synthetic:550:N (uniform 275..825); '256-3072' -> synthetic:<mean>:N:256-3072."""
    if "-" in mix:
        lo, hi = (int(x) for x in mix.split("-"))
        mean = (lo + hi) / 2
        n = max(4, int(round(tokens / mean)))
        return f"synthetic:{int(mean)}:{n}:{lo}-{hi}", mean
    mean = int(mix)
    n = max(4, int(round(tokens / mean)))
    return f"synthetic:{mean}:{n}", float(mean)


def hybrid_hf_config(tiny: bool, layers: int, hidden: int, experts: int) -> tuple[dict, list]:
    """A reduced Qwen3-Next config (fields of transformers' Qwen3NextConfig); keys the installed version does not
    accept are dropped and returned."""
    if tiny:
        layers = 8  # capture layers [1, 2, 3, 4, 5]
        d = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
                 linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
    else:
        d = dict(vocab_size=151936, hidden_size=hidden, intermediate_size=5632, num_hidden_layers=layers,
                 num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
                 linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                 linear_num_value_heads=32)
    d.update(max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
             layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)])
    if experts > 0:
        d.update(num_experts=experts, num_experts_per_tok=min(10, experts), moe_intermediate_size=512,
                 shared_expert_intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[])
    else:
        d.update(mlp_only_layers=list(range(layers)))  # every layer a dense Qwen3NextMLP(intermediate_size)
    dropped = []
    try:
        from transformers import Qwen3NextConfig
        params = inspect.signature(Qwen3NextConfig.__init__).parameters
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            dropped = [k for k in d if k not in params]
            for k in dropped:
                d.pop(k)
    except Exception as e:  # pragma: no cover
        dropped = [f"(could not inspect Qwen3NextConfig: {C.short_error(e)})"]
    d["model_type"] = "qwen3_next"
    return d, dropped


def kernel_packages() -> dict:
    out = {}
    for name in ("fla", "causal_conv1d", "triton"):
        spec = importlib.util.find_spec(name)
        if spec is None:
            out[name] = None
            continue
        try:
            mod = importlib.import_module(name)
            out[name] = {"version": getattr(mod, "__version__", "?"), "path": os.path.dirname(mod.__file__ or "")}
        except Exception as e:
            out[name] = {"import_error": C.short_error(e)}
    return out


# --shape name -> (HF config of the real model's shape, tiny conf/target of the same family for --tiny)
SHAPES = {
    "qwen3_30b_a3b": ({"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                       "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                       "decoder_sparse_step": 1, "norm_topk_prob": True, "num_hidden_layers": 48,
                       "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                       "max_position_embeddings": 40960, "rope_parameters": {"rope_type": "default",
                                                                             "rope_theta": 1000000.0},
                       "rms_norm_eps": 1e-6, "tie_word_embeddings": False}, "tiny_qwen3_moe"),
    "gpt_oss_20b": ({"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
                     "num_local_experts": 32, "num_experts_per_tok": 4, "num_hidden_layers": 24,
                     "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
                     "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
                     "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                         "original_max_position_embeddings": 4096},
                     "rms_norm_eps": 1e-5, "tie_word_embeddings": False}, "tiny_gpt_oss"),
    # Qwen3.5-9B's text model (hybrid: [3 GatedDeltaNet + 1 gated attention] x 8); the capture builds no vision tower
    "qwen3_5_9b": ({"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 4096,
                    "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16,
                    "num_key_value_heads": 4, "head_dim": 256, "linear_conv_kernel_dim": 4,
                    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                    "linear_num_value_heads": 32, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": False,
                    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(32)],
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                        "mrope_section": [11, 11, 10], "mrope_interleaved": True}}, "tiny_qwen3_5"),
}


def shape_target_config(shape: str, tiny: bool, dev_type: str, max_batch_tokens: int) -> TargetConfig:
    hf, tiny_name = SHAPES[shape]
    if tiny:
        return C.target_config(tiny_name, fast_path="allow", max_batch_tokens=max_batch_tokens)
    attn = "sdpa"
    if hf["model_type"] == "gpt_oss":  # sdpa has no sinks (transformers refuses it for gpt_oss)
        attn = "flex_attention" if dev_type == "cuda" else "eager"
    return TargetConfig(hf_config=dict(hf), attn_implementation=attn, fast_path="allow",
                        max_batch_tokens=max_batch_tokens)


def layer_matmul_params(model) -> int:
    from dflash_dist.targets.hf import decoder_layers
    _, layers = decoder_layers(model)
    return sum(p.numel() for p in layers[0].parameters() if p.dim() >= 2)


def approx_flops(tc, per_layer_params: int, layers_run: int, batches: list, lm_head: bool, model=None) -> float:
    """Forward FLOPs over the batches as they run, [(b, S), ...]: with ``model``, ``flops.target_capture_flops``
    (active experts, linear-attention layers, sliding windows); else the dense formula."""
    if model is not None:
        from dflash_dist.targets.hf import decoder_layers
        from dflash_dist.telemetry.flops import target_capture_flops, target_layers_profile
        _, layers = decoder_layers(model)
        return target_capture_flops(target_layers_profile(list(layers)[:layers_run], tc), tc, batches, lm_head)
    return target_forward_flops(tc, per_layer_params * layers_run, layers_run, batches, lm_head)


# name -> (target.packing, target.compile)
VARIANTS = {"padded": (False, False), "padded_compiled": (False, True), "packed": (True, False),
            "packed_compiled": (True, True)}


def measure(fn_batch, inputs, dev, warmup: int, repeats: int) -> tuple[list[float], float]:
    """(seconds per timed pass over all batches, seconds of the warm-up passes); each batch: fn + synchronize,
    as target_loop times busy work."""
    def one_pass():
        for samples in inputs:
            fn_batch(samples)
            C.sync(dev)
    t0 = time.perf_counter()
    for _ in range(warmup):
        one_pass()
    warmup_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - t0)
    return times, warmup_s


def measure_variant(model, layer_ids, variant: str, inputs, dev, args) -> dict:
    """One capture variant over the batches: tok/s, samples/s, peak memory, layers run, the path's description."""
    packing, compile_layers = VARIANTS[variant]
    C.reset_peak(dev)
    capture = FeatureCapture(model, layer_ids, packing=packing, compile=compile_layers)

    def cap(samples):
        ids, lens, _, _ = pad_batch(samples, dev, packing)
        return capture(ids, lens)
    flex_calls = packed_stats["flex_calls"]
    try:
        t, warmup_s = measure(cap, inputs, dev, args.warmup, args.repeats)
    finally:
        capture.close()
    real = sum(len(s.input_ids) for b in inputs for s in b)
    med = C.median(t)
    return {"capture_path": capture.describe(), "capture_s": med, "capture_tokens_per_s": real / med,
            "capture_samples_per_s": sum(len(b) for b in inputs) / med, "capture_pass_s_all": t,
            "warmup_s": warmup_s, "capture_peak_mem_gb": C.mem_gb(dev)["peak_gb"], "layers_run": capture.layers_run,
            "flex_calls_uncompiled": packed_stats["flex_calls"] - flex_calls}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized smoke run")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--hybrid", action="store_true", help="reduced Qwen3-Next-shaped hybrid target")
    p.add_argument("--hybrid-layers", type=int, default=12)
    p.add_argument("--hybrid-hidden", type=int, default=2048)
    p.add_argument("--hybrid-experts", type=int, default=0, help="0: dense MLPs; N: N experts (top-10) per layer")
    p.add_argument("--target", default=None, help="conf/target/<name>.yaml for dense mode (default qwen3_8b_random)")
    p.add_argument("--shape", default=None, choices=sorted(SHAPES),
                   help="a MoE model's shape, random init (with --tiny: the tiny config of the same family)")
    p.add_argument("--experts-implementation", default=None,
                   help="target.experts_implementation for --shape (default: transformers' own, grouped_mm)")
    p.add_argument("--mixes", default=None, help="length mixes, comma list: 550 (275..825) or LO-HI (uniform)")
    p.add_argument("--budgets", default=None, help="token budgets per forward, comma list")
    p.add_argument("--max-batch-samples", type=int, default=64)
    p.add_argument("--tokens-per-pass", type=int, default=None, help="real tokens per timed pass (default 65536)")
    p.add_argument("--warmup", type=int, default=1, help="untimed passes")
    p.add_argument("--repeats", type=int, default=3, help="timed passes (median reported)")
    p.add_argument("--full", dest="full", action="store_true", default=None, help="also time the full forward")
    p.add_argument("--no-full", dest="full", action="store_false")
    p.add_argument("--time-budget-s", type=float, default=0, help="start no new (mix, budget) after this")
    p.add_argument("--variants", default=None,
                   help=f"capture variants, comma list of {', '.join(VARIANTS)}; default padded,packed,packed_compiled "
                        "(--tiny: padded,packed: compiling the layers on a 2-core CPU takes longer than the smoke "
                        "test allows; --hybrid: padded; packed rows of hybrids need fla and causal-conv1d)")
    args = p.parse_args(argv)
    tiny = args.tiny
    dev = C.pick_device(args.device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    t_start = time.time()
    full = args.full if args.full is not None else not args.hybrid
    mixes = (args.mixes or ("64,32-160" if tiny else ("550" if args.hybrid else "550,256-3072"))).split(",")
    budgets = [int(x) for x in (args.budgets or ("256,512" if tiny else ("16384" if args.hybrid else "16384,32768"))
                                ).split(",")]
    tokens_per_pass = args.tokens_per_pass or (1024 if tiny else 65536)
    variants = (args.variants or ("padded" if args.hybrid else "padded,packed" if tiny
                                  else "padded,packed,packed_compiled")).split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad}; known: {', '.join(VARIANTS)}")

    if args.hybrid:
        hf, dropped = hybrid_hf_config(tiny, args.hybrid_layers, args.hybrid_hidden, args.hybrid_experts)
        tcfg = TargetConfig(hf_config=hf, fast_path="allow", max_batch_tokens=max(budgets))
        name = "qwen3_next (reduced)"
    elif args.shape:
        tcfg = shape_target_config(args.shape, tiny, dev.type, max(budgets))
        if args.experts_implementation:
            tcfg.experts_implementation = args.experts_implementation
        name = args.shape + (" (tiny)" if tiny else "")
        dropped = []
    else:
        name = args.target or ("tiny" if tiny else "qwen3_8b_random")
        tcfg = C.target_config(name)
        dropped = []
    packages = kernel_packages() if args.hybrid else None
    model, how, build_s = C.build_target_on_device(tcfg, dev)
    tc = text_config(model.config)
    n_layers = tc.num_hidden_layers
    layer_ids = tcfg.layer_ids or default_layer_ids(n_layers, tcfg.num_feature_layers)
    n_params = sum(p.numel() for p in model.parameters())
    C.log(f"target {name}: {type(model).__name__}, {n_params / 1e9:.2f}B params, {n_layers} layers, "
          f"{next(model.parameters()).dtype}, built in {build_s:.1f} s ({how}); capture layers {layer_ids}")
    result = {"bench": "target_capture", "mode": "hybrid" if args.hybrid else "dense", "env": C.env_info(dev),
              "tiny": tiny, "target": name, "model_class": type(model).__name__, "params": n_params,
              "num_layers": n_layers, "layer_ids": layer_ids, "build_s": build_s, "build": how,
              "max_batch_samples": args.max_batch_samples, "tokens_per_pass": tokens_per_pass,
              "warmup_passes": args.warmup, "repeats": args.repeats, "variants": variants, "rows": [],
              "skipped": []}
    if args.shape:
        from dflash_dist.targets.fast_path import check_target_fast_path
        fp = check_target_fast_path(model, "allow", dev.type)
        ex = fp.get("experts") or {}
        result.update({"fast_path": fp, "fast_path_summary": fp["summary"],
                       "experts_implementation": ex.get("implementation"), "experts": ex,
                       "attn_implementation": fp.get("attn_implementation"),
                       "sdpa_backend": (fp.get("attention") or {}).get("sdpa_backend")})
        C.log(f"fast path: {fp['summary']}")
        C.log(f"experts implementation bound: {ex.get('implementation')}")
        C.write_json(args.out, result)
    if args.hybrid:
        from dflash_dist.targets.fast_path import check_target_fast_path
        fp = check_target_fast_path(model, "allow", dev.type)
        result.update({"hf_config": hf, "hf_config_dropped_keys": dropped, "fast_path": fp,
                       "kernel_packages": packages,
                       "fast_path_summary": fp["summary"]})
        C.log(f"fast path: {fp['summary']}")
        for kind in fp.get("kinds", {}).values():
            for role, bnd in kind.get("bindings", {}).items():
                C.log(f"  {role}: {bnd['impl']} ({'bound' if bnd['bound'] else 'FALLBACK'})")
        C.log(f"kernel packages: {packages}")
        C.write_json(args.out, result)  # the bindings survive a time-out during the measurement
    per_layer = layer_matmul_params(model)

    for mix in mixes:
        source, _ = mix_source(mix, tokens_per_pass)
        ds = synthetic_dataset(source, tc.vocab_size, 3072, seed=0)
        lengths = ds.lengths.tolist()
        for budget in budgets:
            if args.time_budget_s and time.time() - t_start > args.time_budget_s:
                result["skipped"].append({"mix": mix, "budget": budget, "reason": "time budget"})
                continue
            plan = build_plan(lengths, range(len(ds)), epochs=1, seed=1234, max_batch_tokens=budget,
                              max_batch_samples=args.max_batch_samples)
            inputs = [[ds[i] for i in batch] for batch in plan]
            real = sum(lengths)
            shapes = [(len(b), max(lengths[i] for i in b)) for b in plan]
            padded = sum(b * s for b, s in shapes)
            batch_info = {"mix": mix, "source": source, "budget": budget, "samples": len(ds), "batches": len(plan),
                          "real_tokens": real, "padded_tokens": padded, "pad_frac": 1 - real / padded,
                          "mean_sample_len": real / len(ds), "mean_samples_per_batch": len(ds) / len(plan)}
            C.log(f"mix {mix} budget {budget}: {len(ds)} samples in {len(plan)} batches, {real} tokens "
                  f"({100 * batch_info['pad_frac']:.1f}% padding)")
            rows = []
            for variant in variants:
                row = dict(batch_info, variant=variant)
                try:
                    row.update(measure_variant(model, layer_ids, variant, inputs, dev, args))
                    packed = VARIANTS[variant][0]
                    row["tokens_run"] = real if packed else padded
                    if not args.hybrid:  # FLOPs as run: padded rows include the padding, packed rows per sample
                        runs = [(1, lengths[i]) for b in plan for i in b] if packed else shapes
                        row["capture_tflops"] = approx_flops(tc, per_layer, max(layer_ids) + 1, runs, False,
                                                             model) / row["capture_s"] / 1e12
                        peak = nominal_peak_tflops(dev)
                        if peak:
                            row["capture_mfu"] = row["capture_tflops"] / peak
                    C.log(f"  {variant}: {row['capture_tokens_per_s']:,.0f} tok/s, {row['capture_samples_per_s']:.1f} "
                          f"samples/s, warm-up {row['warmup_s']:.1f} s [{row['capture_path']}]")
                    if full and variant == "padded":
                        C.reset_peak(dev)

                        @torch.inference_mode()
                        def full_fwd(samples):
                            ids, _, _, _ = pad_batch(samples, dev)
                            return model(input_ids=ids, use_cache=False, output_hidden_states=True)
                        t, _ = measure(full_fwd, inputs, dev, args.warmup, args.repeats)
                        medf = C.median(t)
                        row.update({"full_s": medf, "full_tokens_per_s": real / medf, "full_pass_s_all": t,
                                    "full_peak_mem_gb": C.mem_gb(dev)["peak_gb"],
                                    "capture_speedup_vs_full": medf / row["capture_s"]})
                        if not args.hybrid:
                            row["full_tflops"] = approx_flops(tc, per_layer, n_layers, shapes, True,
                                                              model) / medf / 1e12
                        C.log(f"  full:    {row['full_tokens_per_s']:,.0f} tok/s -> capture is "
                              f"{row['capture_speedup_vs_full']:.2f}x faster")
                except Exception as e:
                    row["error"] = C.short_error(e)
                    row["oom"] = C.is_oom(e)
                    C.log(f"  {variant} error: {row['error']}")
                    del e
                    C.free_memory(dev)
                rows.append(row)
                result["rows"].append(row)
                C.write_json(args.out, result)
            base = next((r for r in rows if r["variant"] == "padded" and "error" not in r), None)
            for r in rows:
                if base is not None and "error" not in r:
                    r["speedup_vs_padded"] = base["capture_s"] / r["capture_s"]
            result["wall_s"] = time.time() - t_start
            C.write_json(args.out, result)

    cols = [("mix", "mix"), ("budget", "budget"), ("variant", "variant"), ("batches", "batches"),
            ("mean_samples_per_batch", "samples/batch"), ("pad_frac", "pad frac"),
            ("capture_tokens_per_s", "capture tok/s"), ("speedup_vs_padded", "vs padded"),
            ("capture_samples_per_s", "capture samples/s"), ("capture_tflops", "capture TFLOP/s"),
            ("capture_mfu", "capture MFU"),
            ("full_tokens_per_s", "full tok/s"), ("capture_speedup_vs_full", "capture/full speed"),
            ("capture_peak_mem_gb", "peak GB"), ("error", "error")]
    title = (f"target capture ({name}, {dev.type}" + (f"; {result.get('fast_path_summary')}"
                                                      if args.hybrid or args.shape else "") + ")")
    print()
    print(C.table(result["rows"], cols, title=title))
    result["wall_s"] = time.time() - t_start
    C.write_json(args.out, result)
    return 0 if any("error" not in r for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
