"""Pre-quantized FP8 checkpoints of the packaged tiny target, written the way the Hub publishes them: the
decoder layers' projection weights as float8_e4m3fn with their scales, everything else as it was, and the
format's ``quantization_config`` in config.json."""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

from dflash_dist.targets.hf import TINY_DIR

FP8_MAX = 448.0
PROJ = re.compile(r"layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
FINE_GRAINED = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                "modules_to_not_convert": ["lm_head"]}
COMPRESSED = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
              "ignore": ["lm_head"], "config_groups": {"group_0": {
                  "targets": ["Linear"],
                  "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                              "dynamic": False},
                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                        "dynamic": True}}}}


def _blocks(w: torch.Tensor, b: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = w.shape
    grid = torch.zeros(-(-out // b), -(-inp // b))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            grid[i, j] = w[i * b:(i + 1) * b, j * b:(j + 1) * b].abs().amax() / FP8_MAX
    full = grid.repeat_interleave(b, 0)[:out].repeat_interleave(b, 1)[:, :inp]
    return (w / full).to(torch.float8_e4m3fn), grid


def _channels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    return (w / scale).to(torch.float8_e4m3fn), scale


def write_fp8_checkpoint(dst: str, fmt: str, src: str = TINY_DIR, extra_fp8: tuple = ()) -> str:
    """``fmt``: fine_grained (128x128 blocks, weight_scale_inv) or compressed (per-channel weight_scale).
    ``extra_fp8``: further keys written as FP8 weights with a scale (to test what has no Linear)."""
    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for key, w in tensors.items():
        if PROJ.search(key) or key in extra_fp8:
            q, scale = _blocks(w.float()) if fmt == "fine_grained" else _channels(w.float())
            out[key] = q
            out[key[: -len("weight")] + ("weight_scale_inv" if fmt == "fine_grained" else "weight_scale")] = scale
        else:
            out[key] = w
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = FINE_GRAINED if fmt == "fine_grained" else COMPRESSED
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), dst)
    return dst
