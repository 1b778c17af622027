"""How the drafter's training state is spread over the drafter ranks: ``drafter.parallel``.

* ``ddp``: every drafter rank holds the whole drafter, its gradients and AdamW state; DDP all-reduces the gradients
  (``torch.nn.parallel.DistributedDataParallel``, as the trainer always did).
* ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``), each decoder layer its own unit, then the root (fc, the
  norms, a variant's modules after the layers): a rank holds 1/D of every parameter, gradient and AdamW moment
  (fp32), all-gathers a unit's parameters for its forward and backward (bf16 where the drafter computes in bf16,
  ``MixedPrecisionPolicy``) and reduce-scatters its gradients (``drafter.tuning.grad_reduce_dtype``).
* ``auto``: ``fsdp`` where the memory plan says DDP does not fit the device (``planning/memory.choose_parallel``),
  else ``ddp``; the drafter ranks agree on it (one all-reduce).

``DrafterParallel`` is the one place that knows which: the trainer calls its ``module`` for the forward, its
``backward`` for each anchor group's backward, and its ``full_state`` / ``load_optimizer`` for checkpoints, which
hold whole (unsharded) tensors in the same format whichever ran, so any run resumes under either and on any
number of drafter ranks.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DrafterParallel", "MODES", "resolve_mode", "optimizer_state_by_index", "optimizer_state_by_name"]

log = logging.getLogger("dflash_dist")

MODES = ("auto", "ddp", "fsdp")


def _grad_sum(a, b):
    """a + b for gradients that may be None (a parameter a group did not reach), in place into a."""
    return b if a is None else a if b is None else a.add_(b)


def optimizer_state_by_index(state: dict, names: list) -> dict:
    """A whole optimizer state keyed by parameter name (``get_optimizer_state_dict``) in ``torch.optim``'s own
    format, keyed by the parameter's index in ``names`` (``model.named_parameters()`` order): what a checkpoint's
    ``optimizer.pt`` holds whichever way the drafter was trained."""
    index = {n: i for i, n in enumerate(names)}
    groups = [dict(g, params=[index[n] for n in g["params"]]) for g in state["param_groups"]]
    return {"state": {index[n]: v for n, v in state["state"].items()}, "param_groups": groups}


def optimizer_state_by_name(state: dict, names: list) -> dict:
    """The inverse of ``optimizer_state_by_index``: ``torch.optim``'s index-keyed format keyed by parameter name."""
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in state["param_groups"]]
    return {"state": {names[int(i)]: v for i, v in state["state"].items()}, "param_groups": groups}


def resolve_mode(job, device: torch.device) -> tuple[str, str]:
    """(``none`` | ``ddp`` | ``fsdp``, why) for this job's drafter ranks. ``none``: no drafter group (the planner's
    calibration runs the trainer alone). ``auto`` asks the memory plan and the drafters agree: FSDP if the plan of
    any of them says DDP does not fit."""
    mode = job.cfg.drafter.parallel
    group = job.dist.drafters
    if group is None:
        return "none", "one drafter alone"
    if mode != "auto":
        return mode, f"drafter.parallel={mode}"
    from dflash_dist.planning.memory import choose_parallel
    choice, why = choose_parallel(job.cfg, job.hf_config, job.drafter, device.type, len(job.layer_ids),
                                  job.dist.topo.num_drafters, "colocated" if job.dist.topo.colocated else "drafter",
                                  steps=_planned_shapes(job))
    flag = torch.tensor([1.0 if choice == "fsdp" else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item() and choice != "fsdp":
        return "fsdp", "drafter.parallel=auto: another drafter rank's memory plan does not fit DDP"
    return ("fsdp" if flag.item() else "ddp"), f"drafter.parallel=auto: {why}"


def _planned_shapes(job) -> Optional[list]:
    if job.sample_lengths is None:
        return None
    from dflash_dist.planning.memory import plan_steps
    return plan_steps(job.sample_lengths, job.plan, job.cfg.drafter.tuning.ctx_bucket)


class DrafterParallel:
    """The drafter wrapped for data-parallel training over ``group`` (None: alone, nothing wrapped).

    ``model``: the built DFlashDrafter (its weights already loaded on a resume; compile wrappers made), on its
    device. ``reduce_dtype``: the gradients' dtype in the reduction (fp32, or bf16 to halve the traffic)."""

    def __init__(self, model: nn.Module, mode: str, group, device: torch.device,
                 reduce_dtype: torch.dtype = torch.float32, why: str = ""):
        if mode not in ("none", "ddp", "fsdp"):
            raise ValueError(f"drafter.parallel resolved to {mode!r}: none, ddp or fsdp")
        self.model, self.mode, self.group, self.device, self.why = model, mode, group, device, why
        self.reduce_dtype = reduce_dtype
        self.names = [n for n, _ in model.named_parameters()]
        if mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP
            kwargs = {"device_ids": [device.index]} if device.type == "cuda" else {}
            self.module = DDP(model, process_group=group, **kwargs)
            if reduce_dtype == torch.bfloat16:
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
                self.module.register_comm_hook(group, bf16_compress_hook)
        elif mode == "fsdp":
            self._shard(model)
            self.module = model
        else:
            self.module = model

    def _shard(self, model: nn.Module) -> None:
        """fully_shard each decoder layer, then the root (its own parameters: fc, the norms, a variant's modules
        after the layers). Parameters are gathered in bf16 where the drafter computes in bf16 (CUDA: the layers run
        under bf16 autocast anyway), kept and updated in fp32."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        self.mesh = DeviceMesh.from_group(self.group, self.device.type)
        param_dtype = torch.bfloat16 if self.device.type == "cuda" else None
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=self.reduce_dtype)
        for layer in model.layers:
            fully_shard(layer, mesh=self.mesh, mp_policy=policy)
        fully_shard(model, mesh=self.mesh, mp_policy=policy)

    @property
    def wrapped(self) -> bool:
        """Whether a gradient reduction runs at all (False: the trainer alone)."""
        return self.mode != "none"

    @property
    def sharded(self) -> bool:
        """FSDP: every forward is a collective (all-gathers), so every drafter runs the same forwards (dry steps
        included), and gathering the whole state is a collective too."""
        return self.mode == "fsdp"

    def describe(self) -> str:
        if self.mode == "fsdp":
            n = self.mesh.size()
            return (f"FSDP2 over {n} drafter rank(s) ({self.why}): each holds 1/{n} of the parameters, gradients and "
                    f"AdamW state; gradients reduced in {str(self.reduce_dtype).removeprefix('torch.')}")
        if self.mode == "ddp":
            return (f"DDP ({self.why}): every drafter rank holds the whole training state; gradients all-reduced in "
                    f"{str(self.reduce_dtype).removeprefix('torch.')}")
        return "no gradient reduction (one drafter alone)"

    # ------------------------------------------------------------------ a step
    def forward_context(self, later: bool):
        """Around an anchor group's forward; ``later``: a group before the step's last (DDP's reducer is armed
        by the last forward only, see ``backward``)."""
        if later and self.mode == "ddp":
            return self.module.no_sync()
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, last: bool, held: Optional[list]) -> Optional[list]:
        """One anchor group's backward, in order; returns what the next call takes as ``held``. DDP (and alone):
        the earlier groups' gradients come from ``autograd.grad``, kept out of ``.grad`` (DDP's hooks would take
        them for the step's), and are put in ``.grad`` before the last group's backward, which accumulates onto
        them where DDP's reducer, armed by the last forward, sees the sum and all-reduces it. FSDP: each group's
        backward accumulates into the gathered gradients, and only the last one reduce-scatters them."""
        if self.mode == "fsdp":
            self.module.set_requires_gradient_sync(last)
            self.module.set_is_last_backward(last)
            loss.backward()
            return None
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not last:
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            return list(grads) if held is None else [_grad_sum(h, x) for h, x in zip(held, grads)]
        for p, h in zip(params, held or ()):
            p.grad = _grad_sum(p.grad, h)
        loss.backward()
        return None

    def dry_context(self):
        """Around a dry step (precompile: forward and backward, gradients dropped). DDP: no all-reduce. FSDP: its
        gathers and reductions run (every drafter runs the same dry steps); the caller drops the gradients."""
        if self.mode == "ddp":
            return self.module.no_sync()
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ whole state
    def full_state(self, opt: Optional[torch.optim.Optimizer] = None) -> tuple[dict, dict]:
        """(model state, optimizer state) of whole tensors on the leader (global rank 0, the first drafter), in
        the format of ``model.state_dict()`` / ``torch.optim``'s index-keyed ``state_dict()``; ({}, {}) on the other
        ranks. Every drafter calls it at the same point: under FSDP it gathers (a collective; whole tensors reach
        the leader's host memory, one at a time)."""
        leader = dist.get_rank() == 0 if dist.is_initialized() else True
        if self.mode != "fsdp":
            if not leader:
                return {}, {}
            return self.model.state_dict(), (opt.state_dict() if opt is not None else {})
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(self.model, options=options)
        optim = get_optimizer_state_dict(self.model, opt, options=options) if opt is not None else {}
        if not leader:
            return {}, {}
        if not optim:
            return weights, {}
        whole = optimizer_state_by_index(optim, self.names)
        whole["param_groups"] = opt.state_dict()["param_groups"]  # the settings as torch.optim writes them
        return weights, whole

    def gathered_weights(self) -> Optional[dict]:
        """Under FSDP, the whole weights on the leader ({} elsewhere; every drafter calls it at the same step);
        None otherwise (the leader reads its own whole model)."""
        return self.full_state()[0] if self.mode == "fsdp" else None

    def load_optimizer(self, opt: torch.optim.Optimizer, state: dict) -> None:
        """A checkpoint's optimizer state (whole tensors, index-keyed) into ``opt``: as is, or under FSDP each
        rank's shard of every moment (``set_optimizer_state_dict``)."""
        if self.mode != "fsdp":
            opt.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(self.model, opt, optimizer_state_by_name(state, self.names),
                                 options=StateDictOptions(full_state_dict=True))
        for group, saved in zip(opt.param_groups, state["param_groups"]):  # the settings as saved (a tuple stays
            group.update({k: v for k, v in saved.items() if k != "params"})  # one), as load_state_dict keeps them

    def fingerprint(self) -> float:
        """A cheap fingerprint of the weights: the sum of the first trainable parameter (under FSDP, of this rank's
        shard of it, so it differs between ranks)."""
        for p in self.model.parameters():
            if p.requires_grad:
                local = p.to_local() if hasattr(p, "to_local") else p
                return float(local.detach().double().sum().item())
        return 0.0
