#!/usr/bin/env python3
"""What the target's own labels cost (``drafter.loss.labels=target``, ``kind=kl``): bytes per token on the wire for
each label source, the tiny target's capture time on this device with each, and for a Qwen3-8B-shaped target the
FLOPs of the full forward + lm_head next to the truncated capture (built on the meta device: nothing allocated).

    python bench/target_labels.py --out /tmp/target_labels.json
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_dist.config import TargetConfig, default_layer_ids
from dflash_dist.targets.hf import build_target_model
from dflash_dist.paths import CONF_DIR
from dflash_dist.roles.target_rank.capture import FeatureCapture
from dflash_dist.roles.target_rank.trace import capture_flops_fn


def wire_bytes(feature_width: int, feature_bytes: int, k: int) -> dict:
    """Bytes per token of a message: token id + loss mask (int64 meta), features, and each label source's extra."""
    return {"features": feature_width * feature_bytes, "ids_and_mask": 16, "extra_data_labels": 0,
            "extra_target_ids": 8, f"extra_top{k}": k * (8 + 4)}


def time_capture(samples: int, length: int, k: int, repeats: int) -> dict:
    model = build_target_model(TargetConfig(hf_config={"builtin": "tiny"}), "cpu")
    layer_ids = default_layer_ids(model.config.num_hidden_layers)
    cap = FeatureCapture(model, layer_ids)
    ids = torch.randint(0, model.config.vocab_size, (samples, length))
    lengths = torch.full((samples,), length)
    runs = {"data": lambda: cap(ids, lengths), "target_ids": lambda: cap.with_labels(ids, lengths),
            f"top{k}": lambda: cap.with_labels(ids, lengths, top_k=k, probs=True)}
    out = {}
    for name, fn in runs.items():
        fn()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        out[name] = round((time.perf_counter() - t0) / repeats * 1e3, 2)
    cap.close()
    feat = len(layer_ids) * model.config.hidden_size
    return {"capture_ms": out, "tokens": samples * length, "layer_ids": layer_ids,
            "bytes_per_token": wire_bytes(feat, 4, k)}


def flops_8b(k: int) -> dict:
    raw = OmegaConf.to_container(OmegaConf.load(f"{CONF_DIR}/target/qwen3_8b_random.yaml"))["hf_config"]
    cfg = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    job = SimpleNamespace(layer_ids=[1, 9, 17, 25, 33], hf_config=cfg)
    lengths = [1024] * 8
    truncated = capture_flops_fn(model, job)(lengths)
    full = capture_flops_fn(model, job, own_labels=True)(lengths)
    return {"truncated_tflop": round(truncated / 1e12, 2), "with_labels_tflop": round(full / 1e12, 2),
            "extra_frac": round(full / truncated - 1, 4),
            "bytes_per_token": wire_bytes(5 * cfg.hidden_size, 2, k)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)  # as a target rank under torchrun (OMP_NUM_THREADS=1)
    res = {"tiny_cpu": time_capture(a.samples, a.length, a.top_k, a.repeats), "qwen3_8b": flops_8b(a.top_k)}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
