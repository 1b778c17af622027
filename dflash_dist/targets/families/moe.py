"""Mixture-of-experts decoders (Qwen3-MoE; the experts of gpt-oss and the Qwen3.5-MoE hybrid use the same rules):
the drafter's MLP width without a dense ``intermediate_size``, and what the built experts really run.

transformers 5 runs fused ``*Experts`` modules by ``config._experts_implementation`` (grouped_mm by default) but
falls back, silently, to a loop over experts when its per-call check refuses grouped_mm (dtype, device, torch
version), and some experts classes ignore the setting; on a GPU both are the slow path. ``experts_report`` says
which one a built model runs; ``targets/fast_path.py`` reports it and enforces ``target.fast_path``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from dflash_dist.targets.families.base import cfg_get
from dflash_dist.targets.families.dense import DEFAULT

# experts implementations that are the slow path on a GPU
SLOW_EXPERTS = ("eager", "grouped_mm->fallback_loop", "module_loop")

EXPERTS_FIX = ("set target.experts_implementation=grouped_mm (transformers' default; needs torch >= 2.9 and an SM80+ "
               "GPU, bf16 weights under torch.compile) or batched_mm, and check that the model class supports "
               "setting it (transformers >= 5 decorates its experts with @use_experts_implementation); "
               "target.fast_path=warn or allow runs the eager experts anyway")


def mlp_width(tc: Any) -> Optional[int]:
    """The target's ``intermediate_size`` where it has one (Qwen3-MoE's dense width); else the active width, top-k
    experts plus the shared expert (Qwen3.5-MoE)."""
    inter = cfg_get(tc, "intermediate_size")
    if inter:
        return int(inter)
    width, k = cfg_get(tc, "moe_intermediate_size"), cfg_get(tc, "num_experts_per_tok")
    if width and k:
        return int(width) * int(k) + int(cfg_get(tc, "shared_expert_intermediate_size") or 0)
    return None


def _is_experts_module(name: str, mod: Any) -> bool:
    """An experts container: transformers 5's fused ``*Experts`` modules, or an ``experts`` ModuleList of
    per-expert MLPs (older modeling code)."""
    return type(mod).__name__.endswith("Experts") or (name.split(".")[-1] == "experts"
                                                      and type(mod).__name__ == "ModuleList")


def _expert_weight(mod: Any):
    for name in ("gate_up_proj", "up_proj", "down_proj"):
        w = getattr(mod, name, None)
        if w is not None and getattr(w, "dim", lambda: 0)() == 3:
            return w
    return None


def _grouped_mm_usable(weight) -> Optional[bool]:
    """transformers' own per-call test (``integrations.moe._can_use_grouped_mm``) on the experts' weight; None
    when this transformers has no such test."""
    try:
        from transformers.integrations.moe import _can_use_grouped_mm
    except Exception:
        return None
    import torch
    x = torch.empty(16, weight.shape[-2] if weight.dim() == 3 else 1, dtype=weight.dtype, device=weight.device)
    offs = torch.zeros(weight.shape[0], dtype=torch.int32, device=weight.device)
    try:
        return bool(_can_use_grouped_mm(x, weight, offs))
    except Exception:
        return None


def experts_report(model: Any) -> Optional[dict]:
    """What the MoE experts of a built model run: {count, classes, implementation, requested, grouped_mm_usable,
    detail}; None for a model without MoE experts. ``implementation``: the resolved name (grouped_mm,
    batched_mm, eager, ...), ``grouped_mm->fallback_loop`` when grouped_mm is configured but transformers'
    per-call check sends it to its loop fallback, ``module_loop`` for an experts class that ignores
    experts_implementation (a per-expert Python loop)."""
    mods = [(n, m) for n, m in model.named_modules() if _is_experts_module(n, m)]
    if not mods:
        return None
    name, first = mods[0]
    classes = sorted({type(m).__name__ for _, m in mods})
    decorated = hasattr(type(first).forward, "__wrapped__") and hasattr(first, "config")
    requested = getattr(getattr(model, "config", None), "_experts_implementation", None)
    out: dict = {"count": len(mods), "classes": classes, "requested": requested, "grouped_mm_usable": None}
    if not decorated:
        out.update(implementation="module_loop",
                   detail=f"{classes[0]}.forward does not dispatch on experts_implementation (per-expert loop)")
        return out
    impl = getattr(first.config, "_experts_implementation", None) or "eager"
    out["implementation"] = impl
    detail = f"{classes[0]} x{len(mods)}: config._experts_implementation={impl}"
    if impl == "grouped_mm":
        w = _expert_weight(first)
        usable = _grouped_mm_usable(w) if w is not None else None
        out["grouped_mm_usable"] = usable
        if usable is False:
            out["implementation"] = "grouped_mm->fallback_loop"
            detail += (f" but transformers' _can_use_grouped_mm is false for its {w.dtype} weights on {w.device} "
                       "(runs transformers::grouped_mm_fallback, a loop over experts)")
        else:
            try:
                import torch
                fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
                detail += f" -> {getattr(fn, '__module__', 'torch')}.{getattr(fn, '__name__', '?')}"
            except Exception:  # pragma: no cover
                pass
    out["detail"] = detail
    return out


FAMILIES = (
    replace(DEFAULT, name="qwen3_moe", model_types=("qwen3_moe", "qwen2_moe"), mlp_width=mlp_width),
)
