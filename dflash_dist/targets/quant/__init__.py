"""FP8 targets: the FP8 linear layer (``fp8``), loading pre-quantized checkpoints and quantizing on load
(``load``), the report the fast-path check prints (:func:`quantization_report`) and the per-layer feature cosine
of an FP8 target against its bf16 reference (``compare``)."""

from __future__ import annotations

from typing import Optional

from dflash_dist.config import TargetConfig
from dflash_dist.targets.quant.fp8 import KERNEL_NAMES, FP8Linear, default_kernel
from dflash_dist.targets.quant.load import ATTR, checkpoint_format, load_fp8_linears, quantize_linears, strip_quantization
from dflash_dist.targets.quant.shards import check_replica_layouts

__all__ = ["FP8Linear", "apply_quantization", "checkpoint_format", "quantization_report", "strip_quantization",
           "target_is_fp8"]


def apply_quantization(model, layers, tcfg: TargetConfig, fmt, path: Optional[str], device: str,
                       replica: bool = False) -> Optional[dict]:
    """The FP8 step of building a target: a pre-quantized checkpoint's FP8 linears (``fmt`` from
    :func:`checkpoint_format`), else ``target.quantization=fp8`` on the decoder ``layers``; None for neither.
    ``replica``: the model is this rank's shard of a target replica (each FP8 linear holds its shard,
    ``quant/shards.py``)."""
    if fmt is None and tcfg.quantization != "fp8":
        return None
    if replica:
        check_replica_layouts(layers)
    kernel = default_kernel(device)
    if fmt is not None:
        info = load_fp8_linears(model, path, fmt, kernel)
        model.to(device)  # the FP8 tensors were read on the CPU
        return info
    if tcfg.quantization == "fp8":
        return quantize_linears(model, layers, kernel)
    return None


def target_is_fp8(tcfg: TargetConfig, hf_config) -> bool:
    """Whether the target runs FP8 GEMMs (target.quantization=fp8 or a pre-quantized FP8 checkpoint)."""
    return tcfg.quantization == "fp8" or (tcfg.name_or_path is not None and checkpoint_format(hf_config) is not None)


def quantization_report(model) -> Optional[dict]:
    """What the target's linears run: None for a target without FP8 linears and none asked for; else {method,
    source, kernels, kernel_names, fp8_linears, fallback, summary}. ``fallback``: FP8 was asked for but some or all
    linears run without an FP8 GEMM (the dequantize reference, or no FP8 linear at all)."""
    info = getattr(model, ATTR, None)
    mods = [m for m in model.modules() if isinstance(m, FP8Linear)]
    if info is None and not mods:
        return None
    kernels = sorted({m.kernel for m in mods})
    out = dict(info or {"method": "fp8", "source": "FP8Linear modules"})
    out.update({"fp8_linears": len(mods), "kernels": kernels, "kernel_names": [KERNEL_NAMES[k] for k in kernels],
                "fallback": not mods or any(k != "scaled_mm" for k in kernels)})
    gemm = " + ".join(out["kernel_names"]) or "none (no FP8 linear)"
    out["rowwise_shards"] = sum(m.reduce_group is not None for m in mods)
    shards = f" ({out['rowwise_shards']} rowwise shards summed over the replica)" if out["rowwise_shards"] else ""
    out["summary"] = f"quantization: fp8, {out['source']}, {len(mods)} FP8 linears{shards}, GEMM: {gemm}"
    return out
