#!/usr/bin/env python3
"""One compiled drafter layer, forward + backward: the bytes inductor's kernels read and write, and the time.

A layer variant or setting that moves fewer bytes through the layer's fused (memory-bound) kernels is a candidate
for a faster step; this counts them without a GPU. Per ``--drafters`` entry (``bench/drafter_step.py``'s
``VARIANT@BLOCK`` labels, each optionally followed by ``:SECTION.KEY=VALUE`` settings of ``drafter.*``, e.g.
``dflash2@8:dflash2.conv_dtype=input``): the first decoder layer of that drafter, compiled as the trainer
compiles it (``torch.compile(layer, fullgraph=True)``; on CUDA through ``configure_compile``, flex attention in
the layer's graph; on CPU with the sdpa mask), run once forward and backward under bf16 autocast on inputs the
drafter's forward gives a layer (fp32 block states and context, the rotary tables, the mask), and

* ``inductor_mb``: the bytes every scheduled node of the forward and backward graphs reads and writes (inductor's
  own count, ``GraphLowering.count_bytes``: its fused kernels and the extern kernels' operands; caches off, so
  each graph is lowered here). On CPU the kernels are inductor's C++ ones, on CUDA its Triton ones; the two
  schedulers fuse alike but not identically, so compare rows of one device.
* on CUDA, ``ms_fwd_bwd``: the median of ``--repeats`` forward + backward passes after the compile.

The default shape is a quarter of a Qwen3-8B drafter layer with its proportions (hidden 1024, 8 query heads of
128, 2 kv heads, MLP 3072; 1024 query rows over 768 context rows, as 512 anchors x 8 over a 3K context are at full
size): it runs on a 2-core CPU in under 30 s per entry. ``--full`` takes the Qwen3-8B sizes (GPU), ``--tiny``
a smoke run's.

    python bench/layer_bytes.py --drafters dflash@8,dflash2@8:dflash2.conv_dtype=input,dflash2@8
    python bench/layer_bytes.py --full --drafters dflash2@8:dflash2.conv_dtype=input,dflash2@8 --out lb.json
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (puts the repo root on sys.path)
import torch  # noqa: E402
from drafter_step import drafter_variant_config  # noqa: E402

from dflash_dist.model.masks import dense_mask, flex_block_mask  # noqa: E402
from dflash_dist.model.spec import resolve_drafter  # noqa: E402

QUARTER = {"hidden": 1024, "heads": 8, "kv_heads": 2, "head_dim": 128, "intermediate": 3072, "rows": 1024,
           "ctx": 768}
TINY = {"hidden": 128, "heads": 4, "kv_heads": 2, "head_dim": 32, "intermediate": 384, "rows": 128, "ctx": 96}
FULL = {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "intermediate": 12288, "rows": 4096,
        "ctx": 3072}


def target_text_config(shape: dict, vocab: int = 1024):
    """A Qwen3 config of the target whose drafter layer is measured (only the layer's sizes matter here)."""
    from transformers import Qwen3Config
    return Qwen3Config(hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
                       num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                       intermediate_size=shape["intermediate"], num_hidden_layers=8, vocab_size=vocab,
                       max_position_embeddings=4 * (shape["ctx"] + shape["rows"]))


def layer_and_inputs(label: str, shape: dict, dev: torch.device, seed: int = 0):
    """(the compiled first layer of the drafter ``label``, its inputs): h and ctx fp32 [1, rows|ctx, H] as the
    drafter's forward makes them (hidden_norm's and the embedding's output in the fp32 weights' dtype), rotary
    tables, and the mask of ``rows / block`` anchors (flex BlockMask on CUDA, the sdpa mask elsewhere)."""
    dc = drafter_variant_config(False, label)  # the paper's preset (DFlash2: the released conv and selector sizes)
    dc.num_layers = 1
    backend = "flex" if dev.type == "cuda" else "sdpa"
    spec = resolve_drafter(dc, target_text_config(shape), 5, dev.type)
    torch.manual_seed(seed)
    model = spec.build_model(backend).to(dev)
    block = spec.model.block_size
    n = shape["rows"] // block
    g = torch.Generator().manual_seed(seed)
    anchors = torch.sort(torch.randperm(shape["ctx"] - block, generator=g)[:n] + 1).values[None].to(dev)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    q_len, ctx_len = n * block, shape["ctx"]
    ctx_pos = torch.arange(ctx_len, device=dev)[None]
    blk_pos = (anchors[..., None] + torch.arange(block, device=dev)).reshape(1, -1)
    if backend == "flex":
        mask = flex_block_mask(anchors, valid, ctx_len, block)
    else:
        mask = dense_mask(anchors, valid, ctx_len, block)
    masks = model._prepare_masks(mask, 1, q_len, ctx_len + q_len, ctx_pos, blk_pos)
    rope_q, rope_k = model.rotary(ctx_pos, blk_pos, torch.float32)
    h = torch.randn(1, q_len, shape["hidden"], device=dev, requires_grad=True)
    ctx = torch.randn(1, ctx_len, shape["hidden"], device=dev, requires_grad=True)
    layer = model.layers[0]
    kind = model.config.kinds[0]
    with torch.no_grad():  # DFlash2's convolutions away from their identity init, so every term computes
        for name, p in layer.named_parameters():
            if "conv." in name:
                p.normal_(0, 0.02)
    if backend == "flex":  # as the trainer compiles its layers (drafter.tuning.compile_layers)
        model.configure_compile(flex_dynamic=True, compile_layers=True)
        return model._layer_fns[0], (h, ctx, rope_q, rope_k, masks[kind], backend)
    return torch.compile(layer, fullgraph=True), (h, ctx, rope_q, rope_k, masks[kind], backend)


def saved_by_dtype(out: torch.Tensor, exclude: set) -> dict:
    """{dtype: bytes} of the tensors the autograd graph behind ``out`` keeps for its backward (each storage once;
    ``exclude``: storages that exist anyway, the parameters and inputs): what a step's activations hold per layer."""
    seen, by, todo, visited = set(), {}, [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        kept = list(getattr(node, "saved_tensors", None) or [])  # a compiled graph's (autograd.Function) saves
        for name in dir(node):                                   # an eager op's saves
            if name.startswith("_saved_"):
                v = getattr(node, name, None)
                kept += [v] if isinstance(v, torch.Tensor) else [t for t in v if isinstance(t, torch.Tensor)] \
                    if isinstance(v, (list, tuple)) else []
        for t in kept:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen and ptr not in exclude:
                seen.add(ptr)
                key = str(t.dtype).removeprefix("torch.")
                by[key] = by.get(key, 0) + t.untyped_storage().nbytes()
        todo += [f for f, _ in node.next_functions]
    return by


def saved_per_layer(label: str, shape: dict, dev: torch.device) -> dict:
    """The compiled layer's saved bytes (MB, by dtype) with fp32 weights under bf16 autocast (DDP: the master
    weights are the compute weights) and with bf16 weights (FSDP2's bf16 gathered weights), next to the eager
    count the memory plan uses (``planning.memory.layer_saved`` at 2 bytes an element)."""
    from dflash_dist.planning.memory import layer_saved
    row = {"plan_eager_count_mb": 2 * layer_saved(shape["rows"], shape["ctx"], shape["hidden"], shape["heads"],
                                                  shape["kv_heads"], shape["head_dim"], shape["intermediate"]) / 1e6}
    for mode in ("fp32_weights", "bf16_weights"):
        torch._dynamo.reset()
        fn, args = layer_and_inputs(label, shape, dev)
        layer = getattr(fn, "_orig_mod", None) or getattr(fn, "__self__", None)
        params = list(layer.parameters()) if isinstance(layer, torch.nn.Module) else []
        if mode == "bf16_weights":
            with torch.no_grad():
                for p in params:
                    p.data = p.data.to(torch.bfloat16)
            args = tuple(a.detach().to(torch.bfloat16).requires_grad_() if isinstance(a, torch.Tensor)
                         and a.requires_grad else a for a in args)
        exclude = {t.untyped_storage().data_ptr() for t in params + [a for a in args if isinstance(a, torch.Tensor)]}
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out = fn(*args)
        by = saved_by_dtype(out, exclude)
        row[f"saved_mb_{mode}"] = sum(by.values()) / 1e6
        row[f"saved_mb_{mode}_by_dtype"] = {k: v / 1e6 for k, v in by.items()}
        row[f"{mode}_over_plan"] = row[f"saved_mb_{mode}"] / row["plan_eager_count_mb"]
    return row


def run_once(fn, args, dev) -> None:
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        out = fn(*args)
    out.float().square().mean().backward()


def measure(label: str, shape: dict, dev: torch.device, repeats: int) -> dict:
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.metrics as metrics
    row = {"drafter": label}
    fn, args = layer_and_inputs(label, shape, dev)
    torch._dynamo.reset()
    metrics.reset()
    log = compile_fx.inductor_metrics_log
    level = log.level
    log.setLevel(logging.INFO)      # inductor counts the bytes of each graph only with its metrics log on
    try:
        run_once(fn, args, dev)
    finally:
        log.setLevel(level)
    row["inductor_mb"] = metrics.num_bytes_accessed / 1e6
    row["kernels"] = int(metrics.generated_kernel_count)
    if dev.type == "cuda":
        times = C.time_repeats(lambda: run_once(fn, args, dev), dev, warmup=2, repeats=repeats)
        row["ms_fwd_bwd"] = C.median(times) * 1e3
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drafters", default="dflash@8,dflash2@8:dflash2.conv_dtype=input,dflash2@8",
                   help="comma list of VARIANT@BLOCK[:SECTION.KEY=VALUE...]")
    p.add_argument("--full", action="store_true", help="the Qwen3-8B drafter layer's sizes (a GPU's work)")
    p.add_argument("--tiny", action="store_true", help="a CPU smoke run (hidden 128, 128 rows)")
    p.add_argument("--repeats", type=int, default=20, help="timed passes on CUDA")
    p.add_argument("--device", default="auto")
    p.add_argument("--saved", action="store_true", help="instead of the bytes moved: the bytes each compiled "
                   "layer keeps for its backward, with fp32 weights under autocast (DDP) and bf16 weights (FSDP2)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dev = C.pick_device(args.device)
    import torch._inductor.config as ic
    ic.force_disable_caches = True  # every graph lowered (and counted) here, none loaded from the cache
    shape = FULL if args.full else TINY if args.tiny else QUARTER
    result = {"bench": "layer_bytes", "env": C.env_info(dev), "shape": shape, "rows": []}
    for label in [d.strip() for d in args.drafters.split(",") if d.strip()]:
        try:
            row = ({"drafter": label, **saved_per_layer(label, shape, dev)} if args.saved
                   else measure(label, shape, dev, args.repeats))
        except Exception as e:  # an entry that fails is a row with its error, the others still run
            row = {"drafter": label, "error": C.short_error(e)}
        result["rows"].append(row)
        C.log(f"{label}: {row}")
        C.write_json(args.out, result)
    cols = ([("drafter", "drafter"), ("plan_eager_count_mb", "plan's eager count MB"),
             ("saved_mb_fp32_weights", "saved MB, fp32 weights + autocast"), ("fp32_weights_over_plan", "/ plan"),
             ("saved_mb_bf16_weights", "saved MB, bf16 weights"), ("bf16_weights_over_plan", "/ plan"),
             ("error", "error")] if args.saved else
            [("drafter", "drafter"), ("inductor_mb", "MB read + written (inductor)"), ("kernels", "kernels"),
             ("ms_fwd_bwd", "ms fwd+bwd"), ("error", "error")])
    print(C.table(result["rows"], cols,
                  title=f"one drafter layer, forward + backward ({dev.type}; rows {shape['rows']}, ctx {shape['ctx']}, "
                        f"hidden {shape['hidden']})"))
    return 0 if all("error" not in r for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
