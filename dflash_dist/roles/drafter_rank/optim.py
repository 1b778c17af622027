"""The drafter's optimizer step: clip the gradients to a global norm, then AdamW.

Two implementations of the same update, both over the state of one ``torch.optim.AdamW`` (its state dict, and so
every checkpoint, is the same whichever ran):

* ``fused`` (CUDA) / eager (CPU): the norm, then torch's AdamW. The fused kernel takes the clip factor as its
  ``grad_scale``, but it then writes every unscaled gradient back to memory.
* ``compiled`` (CUDA): torch's own multi-tensor AdamW (``torch.optim.adamw.adamw``, ``foreach`` and
  ``capturable``) with the clip factor applied inside one ``torch.compile`` region. Inductor lowers the foreach ops
  into multi-tensor kernels that read each parameter's weight, gradient and two moments once and write the weight
  and the moments: no gradient is written. The learning rate and the clip factor are device tensors, so a new lr
  every step compiles nothing new. Measured against the fused step: docs/benchmarks.md#optimizer-step.

``make_step(opt, mode)`` returns the step function the trainer calls every step.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["clip_factor", "fused_clipped_step", "sharded_clipped_step", "CompiledClippedAdamW", "make_step",
           "STEP_MODES"]

STEP_MODES = ("auto", "fused", "compiled")


def clip_factor(gnorm: Tensor, max_norm: float) -> Tensor:
    """clip_grad_norm_'s multiplier, min(max_norm / (norm + 1e-6), 1), as a device scalar (no sync)."""
    return torch.clamp(max_norm / (gnorm.float() + 1e-6), max=1.0)


def fused_clipped_step(opt: torch.optim.Optimizer, params: list, max_norm: float) -> Tensor:
    """``clip_grad_norm_(params, max_norm)`` then ``opt.step()``; returns the norm before clipping. A fused optimizer
    (AdamW on CUDA) takes the clip factor as its ``grad_scale`` (it divides every gradient by it inside its own
    pass) instead of a separate pass that multiplies 1B fp32 gradients in place (measured:
    docs/benchmarks.md#drafter-step-profile)."""
    if not opt.defaults.get("fused"):
        gnorm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        return gnorm
    grads = [p.grad for p in params if p.grad is not None]
    gnorm = torch.nn.utils.get_total_norm(grads, 2.0)
    opt.grad_scale = 1.0 / clip_factor(gnorm, max_norm)  # the divisor grad / grad_scale
    try:
        opt.step()
    finally:
        del opt.grad_scale
    return gnorm


def sharded_clipped_step(opt: torch.optim.Optimizer, params: list, max_norm: float) -> Tensor:
    """The clip and step of sharded parameters (FSDP2's DTensors, ``roles/drafter_rank/parallel.py``): the global norm from
    every rank's shards (``get_total_norm`` gives a partial DTensor; ``full_tensor`` all-reduces it), the
    gradients scaled by the clip factor, then ``opt.step()`` (fused on CUDA). Returns the norm before clipping,
    a plain tensor, the same on every rank."""
    grads = [p.grad for p in params if p.grad is not None]
    gnorm = torch.nn.utils.get_total_norm(grads, 2.0)
    if hasattr(gnorm, "full_tensor"):
        gnorm = gnorm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, gnorm)
    opt.step()
    return gnorm


def _clipped_adamw(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, steps: list, factor: Tensor,
                   lr: Tensor | float, beta1: float, beta2: float, eps: float, weight_decay: float,
                   capturable: bool) -> None:
    """torch's multi-tensor AdamW on the clipped gradients (the region torch.compile sees; ``capturable`` with a
    tensor ``lr`` on CUDA, a float ``lr`` and host step counts elsewhere)."""
    from torch.optim.adamw import adamw
    scaled = torch._foreach_mul(grads, factor)  # not in place: inductor fuses it into the update's reads
    adamw(params, scaled, exp_avgs, exp_avg_sqs, [], steps, foreach=True, capturable=capturable, differentiable=False,
          fused=None, grad_scale=None, found_inf=None, has_complex=False, amsgrad=False, beta1=beta1, beta2=beta2,
          lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)


class CompiledClippedAdamW:
    """The clip and the AdamW step of ``opt`` (a ``torch.optim.AdamW`` without amsgrad, one param group) in one
    compiled region. The state (``exp_avg``, ``exp_avg_sq``, ``step`` per parameter) is created in ``opt.state``
    the way torch creates it for a capturable AdamW, so ``opt.state_dict()`` saves it and a fused AdamW resumes it."""

    def __init__(self, opt: torch.optim.Optimizer):
        if not isinstance(opt, torch.optim.AdamW):
            raise TypeError(f"the compiled step is AdamW's; got {type(opt).__name__}")
        if len(opt.param_groups) != 1 or opt.param_groups[0]["amsgrad"] or opt.param_groups[0]["maximize"]:
            raise ValueError("the compiled AdamW step takes one param group, without amsgrad or maximize")
        self.opt = opt
        self.params = [p for p in opt.param_groups[0]["params"] if p.requires_grad]
        self.device = self.params[0].device
        if self.device.type != "cuda":
            # torch's multi-tensor AdamW takes a tensor lr only when capturable, and capturable only on accelerators
            raise ValueError(f"drafter.tuning.optimizer_step=compiled runs on CUDA; the parameters are on {self.device} "
                             "(use fused or auto)")
        self.lr = torch.zeros((), dtype=torch.float32, device=self.device)
        self._fn = torch.compile(_clipped_adamw, fullgraph=True)

    def _state(self, params: list) -> tuple[list, list, list]:
        m, v, s = [], [], []
        for p in params:
            st = self.opt.state[p]
            if not st:  # what torch's AdamW makes on the first step (capturable: the count on the device)
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif st["step"].device != p.device:  # a state saved by a non-capturable AdamW keeps it on the host
                st["step"] = st["step"].to(p.device, torch.float32)
            m.append(st["exp_avg"])
            v.append(st["exp_avg_sq"])
            s.append(st["step"])
        return m, v, s

    def __call__(self, max_norm: float) -> Tensor:
        """Clip to ``max_norm`` and step; returns the norm before clipping. A parameter without a gradient is not
        updated (as torch's AdamW skips it); the set is the same every step, so nothing recompiles."""
        params = [p for p in self.params if p.grad is not None]
        grads = [p.grad for p in params]
        if not grads:  # nothing to update (torch's AdamW steps nothing either); never compile an empty graph
            return torch.zeros((), dtype=torch.float32, device=self.device)
        gnorm = torch.nn.utils.get_total_norm(grads, 2.0)
        group = self.opt.param_groups[0]
        self.lr.fill_(float(group["lr"]))  # a device write, no sync; the compiled graph reads the tensor
        m, v, s = self._state(params)
        beta1, beta2 = group["betas"]
        with torch.no_grad():
            self._fn(params, grads, m, v, s, clip_factor(gnorm, max_norm), self.lr, float(beta1), float(beta2),
                     float(group["eps"]), float(group["weight_decay"]), True)
        return gnorm


def make_step(opt: torch.optim.Optimizer, mode: str, sharded: bool = False) -> Callable[[list, float], Tensor]:
    """The step function ``step(params, max_norm) -> grad norm`` for ``drafter.tuning.optimizer_step``: ``fused``
    (torch's AdamW; fused on CUDA), ``compiled`` (CUDA only: ``CompiledClippedAdamW``), ``auto`` = compiled on CUDA,
    fused elsewhere. ``sharded`` (FSDP2 parameters):
    ``sharded_clipped_step`` for ``auto`` and ``fused``; ``compiled`` is refused (the config refuses it first)."""
    if mode not in STEP_MODES:
        raise ValueError(f"drafter.tuning.optimizer_step={mode!r}: one of {', '.join(STEP_MODES)}")
    if sharded:
        if mode == "compiled":
            raise ValueError("drafter.parallel=fsdp: the optimizer step is torch's AdamW on the shards "
                             "(drafter.tuning.optimizer_step=auto or fused)")
        return lambda params, max_norm: sharded_clipped_step(opt, params, max_norm)
    device = opt.param_groups[0]["params"][0].device
    if mode == "auto":
        mode = "compiled" if device.type == "cuda" else "fused"
    if mode == "fused":
        return lambda params, max_norm: fused_clipped_step(opt, params, max_norm)
    step = CompiledClippedAdamW(opt)
    return lambda params, max_norm: step(max_norm)
