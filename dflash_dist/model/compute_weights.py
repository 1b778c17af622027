"""bf16 compute copies of the drafter's fp32 master weights, written once per optimizer step.

Under bf16 autocast every forward casts each fp32 Linear weight to bf16 (a read of 4 and a write of 2 bytes per
parameter, every step). ``Shadows`` keeps that bf16 copy as a buffer instead: the optimizer writes it with the
update (the compiled AdamW step emits it as one more output of the kernel that already holds the new weight,
``roles/drafter_rank/optim.py``), and the Linear's forward multiplies by it directly. The numbers do not change: the copy is
the same cast of the same fp32 weight, the input is cast as autocast casts it, and the weight's gradient is the bf16
product cast to fp32, as autocast's cast backward makes it. Every in-place change of a master weight (the
optimizer's, a checkpoint load, DDP's broadcast) bumps the tensor's version counter; ``ensure_fresh`` compares
them before every forward of the model and recasts what changed, so a stale copy is never used.

Tested on CPU under bf16 autocast (outputs and gradients bit for bit those of autocast's casts, eager and compiled);
on CUDA the compiled optimizer step writes the copies inside its region (tested on an H200). Measured on an H200 it
saves no step time (3K Qwen3-8B shapes: DFlash @ 16 150.5 vs 149.4 ms, DFlash2 @ 8 90.1 vs 89.7 ms;
docs/benchmarks.md#shadow-weights): the optimizer's extra bf16 write costs what the forward's casts cost. So it is
not the default (``drafter.tuning.compute_weights=shadow`` turns it on).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

__all__ = ["Shadows", "MODES", "resolve_mode"]

MODES = ("cast", "shadow")


class _ShadowLinear(torch.autograd.Function):
    """y = x @ shadow.T with x cast to the shadow's dtype; d weight = (dy.T @ x) in the weight's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, shadow: Tensor) -> Tensor:
        x16 = x.to(shadow.dtype)
        ctx.save_for_backward(x16, shadow)
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return torch.nn.functional.linear(x16, shadow)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x16, shadow = ctx.saved_tensors
        grad = grad.to(shadow.dtype)
        grad_x = grad.matmul(shadow).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        grad_w = (grad.reshape(-1, grad.shape[-1]).t().mm(x16.reshape(-1, x16.shape[-1])).to(ctx.w_dtype)
                  if ctx.needs_input_grad[1] else None)
        return grad_x, grad_w, None


def _shadow_forward(module: nn.Linear):
    def forward(x: Tensor) -> Tensor:
        dev = x.device.type  # installed on bias-free Linears only (Shadows)
        if torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) == module.weight_compute.dtype:
            return _ShadowLinear.apply(x, module.weight, module.weight_compute)
        return nn.Linear.forward(module, x)  # outside autocast (evaluation in fp32): the master weight
    return forward


def resolve_mode(mode: str, device: torch.device) -> str:
    """drafter.tuning.compute_weights, checked for ``device``: ``shadow`` needs bf16 autocast (CUDA; on CPU the
    drafter trains in fp32 and nothing is cast)."""
    if mode not in MODES:
        raise ValueError(f"drafter.tuning.compute_weights={mode!r}: one of {', '.join(MODES)}")
    if mode == "shadow" and device.type != "cuda":
        raise ValueError(f"drafter.tuning.compute_weights=shadow: the drafter computes in fp32 on {device.type} "
                         "(no autocast), so there is no cast to save; use cast")
    return mode


class Shadows:
    """The bf16 copies of ``model``'s trainable fp32 Linear weights (bias-free ones: the drafter has no bias),
    as non-persistent buffers ``weight_compute`` (state dicts and checkpoints do not change; DDP must not broadcast
    them: ``buffer_names``)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.modules: list[nn.Linear] = []
        for m in model.modules():
            if (isinstance(m, nn.Linear) and m.bias is None and m.weight.requires_grad
                    and m.weight.dtype == torch.float32):
                m.register_buffer("weight_compute", torch.empty_like(m.weight, dtype=dtype), persistent=False)
                m.forward = _shadow_forward(m)
                self.modules.append(m)
        if not self.modules:
            raise ValueError("drafter.tuning.compute_weights=shadow: the model has no fp32 bias-free Linear weights")
        self.by_param = {id(m.weight): m.weight_compute for m in self.modules}
        self.buffer_names = [f"{name}.weight_compute" for name, m in model.named_modules() if m in self.modules]
        self._versions: list[Optional[int]] = [None] * len(self.modules)
        self.recasts = 0  # copies made outside the optimizer step (init, resume, another in-place change)
        self.ensure_fresh()
        # every forward of the model (training, dry steps, evaluation) first recasts what changed in place
        model.register_forward_pre_hook(self._before_forward)

    def shadows_of(self, params: list[Tensor]) -> list[Optional[Tensor]]:
        """The copy of each of ``params`` (None for a parameter without one)."""
        return [self.by_param.get(id(p)) for p in params]

    @torch.no_grad()
    def ensure_fresh(self) -> int:
        """Recast every copy whose master weight changed since it was written; returns how many."""
        stale = [i for i, m in enumerate(self.modules) if m.weight._version != self._versions[i]]
        if stale:
            torch._foreach_copy_([self.modules[i].weight_compute for i in stale],
                                 [self.modules[i].weight for i in stale])
            self.recasts += len(stale)
        self.mark_fresh()
        return len(stale)

    @torch.compiler.disable  # host-side version checks: under a compiled caller they run eager, never traced
    def _before_forward(self, module, args) -> None:
        self.ensure_fresh()

    def mark_fresh(self) -> None:
        """The copies were written from the current master weights (the optimizer step's own output)."""
        self._versions = [m.weight._version for m in self.modules]

    def describe(self) -> str:
        n = sum(m.weight.numel() for m in self.modules)
        return (f"bf16 copies of {len(self.modules)} fp32 Linear weights ({n / 1e9:.2f}B parameters), written by the "
                "optimizer step")
