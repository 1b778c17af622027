"""``dflash-doctor --compare-quantization``: how far an FP8 target's captured features are from bf16's."""

from __future__ import annotations

from typing import Optional

PASS, WARN, NA = "PASS", "WARN", "N/A"  # dflash-doctor's row statuses


def _capture(model, layer_ids, samples, device):
    import torch

    from dflash_dist.roles.target_rank.batch import pad_batch
    from dflash_dist.roles.target_rank.capture import FeatureCapture
    cap = FeatureCapture(model, layer_ids, packing=False, compile=False)
    try:
        with torch.inference_mode():
            return cap(*pad_batch(samples, torch.device(device), False)[:2]).float().cpu()
    finally:
        cap.close()


def compare_quantization(cfg, hf_config, reference: Optional[str], n_samples: int = 4,
                         length: int = 256) -> tuple[str, str, dict]:
    """Per captured layer, the cosine of the FP8 target's features against its bf16 reference on a few random-token
    samples: ``reference`` (a bf16 checkpoint) when given; else the same target unquantized (target.quantization=
    fp8) or, for a pre-quantized checkpoint, its FP8 weights dequantized (so only the FP8 GEMM differs). The FP8
    side runs ``torch._scaled_mm`` (on CPU too, where torch has it), as the GPU does. Returns the doctor row's
    (status, detail, data): WARN below 0.99, N/A for a target that is not FP8."""
    from dataclasses import replace

    from dflash_dist.config import default_layer_ids, resolve_device
    from dflash_dist.data.synthetic import synthetic_dataset
    from dflash_dist.targets.hf import build_target_model, load_hf_config, text_config
    from dflash_dist.targets.quant import FP8Linear, checkpoint_format, quantization_report, target_is_fp8
    from dflash_dist.targets.quant.compare import layer_cosines
    t = cfg.target
    hf_config = hf_config or load_hf_config(t)
    if not target_is_fp8(t, hf_config):
        return NA, "the target is not FP8 (target.quantization=fp8 or an FP8 checkpoint)", {}
    tc, device = text_config(hf_config), resolve_device(cfg)
    layer_ids = t.layer_ids or default_layer_ids(tc.num_hidden_layers, t.num_feature_layers)
    ds = synthetic_dataset(f"synthetic:{length}:{n_samples}", tc.vocab_size, length, seed=0)
    samples = [ds[i] for i in range(len(ds))]
    fp8 = build_target_model(t, device)
    mods = [m for m in fp8.modules() if isinstance(m, FP8Linear)]
    prequantized = t.name_or_path is not None and checkpoint_format(hf_config) is not None
    if reference or not prequantized:
        what = reference or "the same target unquantized"
        ref = _capture(build_target_model(replace(t, quantization=None, name_or_path=reference or t.name_or_path),
                                          device), layer_ids, samples, device)
    else:
        what = "its FP8 weights dequantized (bf16 activations)"
        for m in mods:
            m.kernel = "dequantize"
        ref = _capture(fp8, layer_ids, samples, device)
    for m in mods:
        m.kernel = "scaled_mm"
    cos = layer_cosines(ref, _capture(fp8, layer_ids, samples, device), len(layer_ids))
    worst = min(c["mean"] for c in cos)
    detail = (f"{quantization_report(fp8)['source']}, FP8 GEMM vs {what}, {n_samples} samples of {length} tokens: "
              + ", ".join(f"layer {i}: {c['mean']:.4f}" for i, c in zip(layer_ids, cos)))
    return (PASS if worst >= 0.99 else WARN), detail, {"cosines": cos, "layer_ids": layer_ids}
