#!/usr/bin/env python3
"""Where an FP8 target's feature error comes from: per-layer cosine against fp32 of the same random-init model with
FP8 rounding applied to parts of it (CPU or GPU, no FP8 kernel needed).

The FP8 linear (``targets/quant/fp8.py``) rounds each weight row and each token's activations to float8 e4m3 with
one scale per row (``quantize_rows``) and multiplies in higher precision; this script applies the same rounding as
quantize-dequantize in fp32, to every decoder linear or to some of them, and compares the hidden state after each
decoder layer (HF ``hidden_states[i+1]``, the capture's "layer i") with the fp32 model's:

* ``fp8``: every linear, weights and activations (what ``target.quantization=fp8`` computes);
* ``fp8_attention`` / ``fp8_mlp``: only the attention projections / only the MLP;
* ``fp8_weights``: weights rounded, activations exact;
* ``fp8_blocks``: 128 x 128 weight blocks and 1 x 128 activation blocks (the fine-grained checkpoints' layout);
* ``bf16``: the whole model in bf16 (RoPE frequencies kept fp32, as the capture computes them): the floor.

    python bench/experiments/fp8_error_sources.py --layers 10 --out fp8_sources.json  # Qwen3-8B shape, 10 layers
    python bench/experiments/fp8_error_sources.py --tiny --out /tmp/fp8_sources.json  # smoke
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _common
import _common as C  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from dflash_dist.targets.quant.fp8 import FP8_DTYPE, FP8_MAX, quantize_rows  # noqa: E402

VARIANTS = ("fp8", "fp8_attention", "fp8_mlp", "fp8_weights", "fp8_blocks", "bf16")


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 with one scale per row (the last dim), back in fp32."""
    q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return (q.float() * scale[:, None]).reshape(x.shape)


def round_blocks(x: torch.Tensor, block: int = 128, rows: int = 1) -> torch.Tensor:
    """x [.., R, K] rounded to e4m3 with one scale per rows x block tile (rows 1: per token and 128 channels)."""
    r, k = x.shape[-2], x.shape[-1]
    v = x.float().reshape(-1, r // rows, rows, k // block, block)
    scale = (v.abs().amax(dim=(2, 4), keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return ((v / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale).reshape(x.shape)


TINY = dict(model_type="qwen3", vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)


def build(tiny: bool, layers: int, device: torch.device) -> transformers.PreTrainedModel:
    """The Qwen3-8B-shaped random-init preset (``conf/target/qwen3_8b_random.yaml``) cut to ``layers``, in fp32."""
    hf = dict(TINY) if tiny else dict(C.target_config("qwen3_8b_random").hf_config)
    hf["num_hidden_layers"] = layers
    cfg = transformers.AutoConfig.for_model(**hf)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@torch.no_grad()
def hidden_after_layers(model, ids: torch.Tensor) -> list[torch.Tensor]:
    return [h[0].float() for h in model.model(input_ids=ids, output_hidden_states=True).hidden_states[1:]]


@torch.no_grad()
def run_variant(model, ids: torch.Tensor, variant: str) -> list[torch.Tensor]:
    linears = {n: m for n, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)}
    if variant == "bf16":
        buffers = {n: b.clone() for n, b in model.named_buffers()}
        model.to(torch.bfloat16)
        for name, b in buffers.items():  # RoPE frequencies stay fp32 (HF computes them so on load)
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, b)
        try:
            return hidden_after_layers(model, ids)
        finally:
            model.to(torch.float32)
    pick = {"fp8_attention": lambda n: "self_attn" in n, "fp8_mlp": lambda n: ".mlp." in n}.get(variant, lambda n: True)
    own, hooks = {}, []
    for name, m in linears.items():
        if not pick(name):
            continue
        own[name] = m.weight.data.clone()
        m.weight.data.copy_(round_blocks(m.weight.data, rows=128) if variant == "fp8_blocks" else round_rows(m.weight.data))
        if variant != "fp8_weights":
            act = (lambda x: round_blocks(x)) if variant == "fp8_blocks" else round_rows
            hooks.append(m.register_forward_pre_hook(lambda mod, args, act=act: (act(args[0].float()),)))
    try:
        return hidden_after_layers(model, ids)
    finally:
        for h in hooks:
            h.remove()
        for name, w in own.items():
            linears[name].weight.data.copy_(w)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=10, help="decoder layers of the Qwen3-8B shape to build (fp32)")
    p.add_argument("--tokens", type=int, default=512, help="random tokens of the one sample")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--tiny", action="store_true", help="a small model (smoke)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = C.pick_device()
    model = build(args.tiny, args.layers, dev)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(1)).to(dev)
    ref = hidden_after_layers(model, ids)
    rows = {}
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            raise SystemExit(f"--variants: {variant!r} is not one of {', '.join(VARIANTS)}")
        t0 = time.perf_counter()
        got = run_variant(model, ids, variant)
        rows[variant] = [float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean()) for a, b in zip(got, ref)]
        print(f"{variant}: {' '.join(f'{c:.4f}' for c in rows[variant])} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\n| variant | {' | '.join(f'layer {i}' for i in range(args.layers))} |")
    print(f"| --- |{' ---: |' * args.layers}")
    for variant, cos in rows.items():
        print(f"| {variant} | {' | '.join(f'{c:.4f}' for c in cos)} |")
    C.write_json(args.out, {"bench": "fp8_error_sources", "env": C.env_info(dev), "tiny": args.tiny,
                            "layers": args.layers, "tokens": args.tokens, "cosine_vs_fp32": rows})


if __name__ == "__main__":
    main()
