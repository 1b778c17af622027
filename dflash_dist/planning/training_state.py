"""The drafter's training state in a rank's memory plan: DDP's whole fp32 copies on every rank, or FSDP2's shards
over the drafter ranks and the moment of its step that peaks (the end of the forward or the start of the backward).

``planning/memory.py`` builds the plan and calls these; ``plan`` is its ``MemoryPlan`` (``parts``: {name: bytes},
``knobs``: {name: the setting that shrinks it}, ``shape``: the step planned for).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from dflash_dist.config import JobConfig

__all__ = ["COMPILED_BF16_LAYERS", "drafter_units", "training_state", "fsdp_peak"]

# Compiled drafter layers on bf16 weights (FSDP2 gathers them in bf16 on a GPU) keep this share of the eager count
# ``layer_saved``: 0.77 in the allocator's trace of a Qwen3-8B-shaped FSDP2 step on an H100, 0.72 for one layer
# alone (bench/memory_plan.py --trace, bench/layer_bytes.py --saved; docs/benchmarks.md#memory-plan-h100).
# DDP's plan keeps the eager count: with fp32 master weights under autocast its layers also keep a bf16 copy of
# every weight, and the count's surplus covers it (measured 0.99-1.10 of its peaks).
COMPILED_BF16_LAYERS = 0.77


def drafter_units(spec: Any, num_drafters: int = 1) -> dict:
    """The drafter's parameter counts as FSDP2 sees them (built on the meta device): ``total``, ``layers`` (each
    decoder layer, a unit of its own), ``root`` (the rest: fc, the norms, a variant's modules after the layers) and
    ``shard``, what one of ``num_drafters`` ranks holds (each tensor split on its first dimension, padded to a
    multiple of the ranks as fully_shard pads it)."""
    import torch
    with torch.device("meta"):
        m = spec.build_model()
    shapes = [tuple(p.shape) for p in m.parameters()]
    D = max(1, int(num_drafters))
    shard = sum(math.ceil(s[0] / D) * math.prod(s[1:]) if s else 1 for s in shapes)
    layers = [int(sum(p.numel() for p in layer.parameters())) for layer in m.layers]
    total = int(sum(math.prod(s) for s in shapes))
    return {"total": total, "layers": layers, "root": total - sum(layers), "shard": int(shard)}


def training_state(plan: Any, spec: Any, device: str, num_drafters: int, parallel: str, cfg: JobConfig) -> None:
    """The drafter's own training state in ``plan.parts``. DDP: fp32 parameters, gradients (and DDP's bucket copy
    with more than one drafter), AdamW's two moments on every rank. FSDP: the same divided by the drafters (each
    rank's shard), plus what the backward's start holds beyond them (gathered weights, a layer's gradients being
    reduced); ``fsdp_peak`` then picks the step's peak moment."""
    u = drafter_units(spec, num_drafters if parallel == "fsdp" else 1)
    n = u["total"]
    if parallel == "fsdp":
        cb = 2 if device == "cuda" else 4  # weights gathered in bf16 where the drafter computes in bf16
        rb = 2 if cfg.drafter.tuning.grad_reduce_dtype == "bfloat16" else 4
        layer = max(u["layers"] or [0])
        plan.parts["parameters (shard)"] = 4 * u["shard"]
        plan.parts["gradients (shard)"] = 4 * u["shard"]
        plan.parts["AdamW state (shard)"] = 8 * u["shard"]
        D = max(1, int(num_drafters))
        # at the start of the backward (the trace of one H100, one rank): the root's and a layer's weights in the
        # compute dtype (with more ranks also the next layer's, prefetched), the layer's gradients in the
        # reduction's dtype and the reduce-scatter's output
        plan.parts["gathered weights"] = cb * (u["root"] + (2 if D > 1 else 1) * layer)
        plan.parts["gathered gradients"] = int(rb * layer * (1 + 1 / D))
        for k in ("parameters (shard)", "gradients (shard)", "AdamW state (shard)"):
            plan.knobs[k] = "more drafter ranks, drafter.num_layers"
        plan.knobs["gathered weights"] = plan.knobs["gathered gradients"] = "drafter.num_layers"
        return
    plan.parts["parameters"] = 4 * n
    plan.parts["gradients"] = 4 * n * (2 if num_drafters > 1 else 1)
    plan.parts["AdamW state"] = 8 * n
    for k in ("parameters", "gradients", "AdamW state"):
        plan.knobs[k] = "drafter.num_layers" + (", drafter.parallel=fsdp" if num_drafters > 1 else "")


def fsdp_peak(plan: Any, spec: Any, device: str, cfg: JobConfig, step_parts: Sequence[str]) -> None:
    """FSDP2's peak, the larger of two moments. At the end of the forward (the loss's chunk alive): every layer's
    saved activations and the root's gathered weights (the layers' are freed after their forward). At the start of
    the backward (the loss freed): the same activations and what ``training_state`` counts for it (the gathered
    weights, a layer's gradients and their reduce-scatter's output). On a GPU the compiled layers compute on bf16
    weights (``COMPILED_BF16_LAYERS``) and the compiled loss keeps its chunk of logits and their gradient in bf16.
    The gradient shards: ``_fsdp_gradients``."""
    m, parts = spec.model, plan.parts
    if device == "cuda" and spec.backend != "sdpa":
        parts["layer activations"] = int(COMPILED_BF16_LAYERS * parts["layer activations"])
        b, q = plan.shape[0], plan.shape[2]
        chunk = min(b * q, spec.loss.chunk_rows)
        parts["loss"] = 2 * chunk * m.vocab_size * 2 + b * q * m.hidden_size * 2 * 2
    u = drafter_units(spec)
    cb = 2 if device == "cuda" else 4
    root_weights = cb * u["root"]
    forward_end = parts.get("loss", 0) + root_weights
    backward_start = parts["gathered weights"] + parts["gathered gradients"]
    if forward_end >= backward_start:
        parts["gathered weights"] = root_weights
        parts.pop("gathered gradients")
    else:
        parts.pop("loss", None)
    acts = sum(v for k, v in parts.items() if k in step_parts)
    _fsdp_gradients(plan, acts, int(cfg.drafter.tuning.micro_batches), spec, device, cfg)


def _fsdp_gradients(plan: Any, acts: int, groups: int, spec: Any, device: str, cfg: JobConfig) -> None:
    """FSDP2's gradients at the step's peak. The trainer drops them after every step (``set_to_none``) and FSDP2
    writes each unit's shard during its backward, as that unit's activations are freed: with one anchor group only
    what the shards exceed the activations by adds to the peak. With more groups, the backwards before the last do
    not reduce (``set_requires_gradient_sync(False)``) and keep every unit's whole gradient until the last one, next
    to the later groups' activations: counted in full, with the shards."""
    shards = plan.parts["gradients (shard)"]
    if groups <= 1:
        plan.parts["gradients (shard)"] = max(0, shards - acts)
        return
    rb = 2 if cfg.drafter.tuning.grad_reduce_dtype == "bfloat16" else 4
    whole = drafter_units(spec)["total"]
    plan.parts["unreduced gradients (earlier anchor groups)"] = max(rb, 2 if device == "cuda" else 4) * whole
    plan.knobs["unreduced gradients (earlier anchor groups)"] = "drafter.tuning.micro_batches=1"
