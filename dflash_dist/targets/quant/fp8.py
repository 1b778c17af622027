"""The FP8 linear layer the target's decoder layers run: float8_e4m3fn weights with one fp32 scale per output
channel, activations quantized per token on the fly, one ``torch._scaled_mm`` (rowwise scales) per call.

Two kernels, chosen once per module and reported by the fast-path check (``targets/fast_path.py``):

* ``scaled_mm``: ``torch._scaled_mm`` with rowwise scales and fast accumulation, FP8 tensor cores (CUDA, compute
  capability >= 8.9: Ada, Hopper, Blackwell). Measured on an H200 at Qwen3-8B capture shapes (M = 16384): 1.4-1.6x
  the bf16 GEMM with the activation quantization included, 1.50x the packed + compiled bf16 capture
  (measured: docs/benchmarks.md#fp8-targets).
* ``dequantize``: the reference path, weights dequantized to the activation dtype then ``F.linear`` (CPU, older
  GPUs). It runs the FP8 weights' values but no FP8 GEMM: ``target.fast_path=require`` refuses it.

Everything in ``forward`` is traceable (no data-dependent Python), so a compiled decoder layer holds its FP8
linears without graph breaks: the per-token amax, the scaling and the cast fuse into one kernel before the GEMM.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
KERNELS = ("scaled_mm", "dequantize")
KERNEL_NAMES = {"scaled_mm": "torch._scaled_mm (FP8 e4m3, rowwise scales)",
                "dequantize": "reference: dequantize-then-matmul (no FP8 GEMM)"}


def default_kernel(device) -> str:
    """``scaled_mm`` where FP8 tensor cores exist (CUDA, capability >= 8.9), else the ``dequantize`` reference."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return "scaled_mm" if torch.cuda.get_device_capability(index) >= (8, 9) else "dequantize"
    return "dequantize"


def quantize_rows(w: torch.Tensor, amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight [out, in], fp32 scale [out]) with w ~= q * scale[:, None]; each row's amax maps to 448.
    ``amax``: the rows' amax when it is not this tensor's own (a replica's rowwise shard: the whole row's)."""
    w = w.float()
    scale = ((w.abs().amax(dim=1) if amax is None else amax.float()) / FP8_MAX).clamp(min=1e-12)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def expand_block_scales(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """A block-wise scale grid [ceil(out/b0), ceil(in/b1)] as one scale per weight element [out, in]."""
    out, inp = shape
    return scale.float().repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]


class FP8Linear(nn.Module):
    """``y = x W^T + b`` with ``W = weight * scale[:, None]`` stored in FP8 (see the module docstring).

    ``source`` says where the FP8 weight came from (a checkpoint format, or quantized on load), for the report.
    ``reduce_group``: on a target replica, the weight is this rank's rowwise shard (its input channels) and the
    output is the partial sum, all-reduced over the group before the bias (``quant/shards.py``)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor], kernel: str,
                 source: str, reduce_group=None):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"FP8Linear kernel {kernel!r}: use one of {', '.join(KERNELS)}")
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(f"FP8Linear weight must be a 2-d {FP8_DTYPE} tensor, got {weight.dtype} {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.contiguous())
        # [1, out] fp32: the layout torch._scaled_mm takes for the second operand's rowwise scales
        self.register_buffer("scale", scale.float().reshape(1, -1).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.kernel = kernel
        self.source = source
        self.reduce_group = reduce_group
        # cuBLAS FP8 fast accumulation: on an H200 at Qwen3-8B shapes 7% more capture tok/s, the features' cosine to
        # bf16 the same to 4 decimals (bench/target_fp8.py --fast-accum)
        self.fast_accum = True

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernel: str, source: str = "quantized on load") -> "FP8Linear":
        q, scale = quantize_rows(linear.weight.detach())
        return cls(q, scale, None if linear.bias is None else linear.bias.detach(), kernel, source)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() * self.scale.reshape(-1, 1)).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce_group is None:
            return self._matmul(x, self.bias)
        y = self._matmul(x, None)
        torch.distributed.all_reduce(y, group=self.reduce_group)  # the replica's partial sums
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.kernel == "dequantize":
            return F.linear(x, self.dequantized_weight(x.dtype), None if bias is None else bias.to(x.dtype))
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        # per-token (rowwise) dynamic activation scales: each row's amax maps to the largest e4m3 value
        xs = (x2.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        xq = (x2.float() / xs).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        # rowwise-scaled FP8 GEMMs write bf16 on CUDA; other activation dtypes are cast back
        out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.scale, out_dtype=out_dtype,
                             use_fast_accum=self.fast_accum)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        shard = "" if self.reduce_group is None else ", rowwise shard"
        return f"in={self.in_features}, out={self.out_features}, kernel={self.kernel}, source={self.source}{shard}"
