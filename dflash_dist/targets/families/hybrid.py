"""Hybrid decoders (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): full-attention layers mixed with GatedDeltaNet
linear-attention layers.

A linear-attention layer carries a recurrent state (and a short convolution's window) along the row: these targets
run packed only through the fast kernels' varlen forms, which restart both at every sample (``hybrid_packing``:
fla's ``cu_seqlens``, causal-conv1d's ``seq_idx``); without them packing is refused and rows run padded. Their
prefill needs the same two external kernels, and transformers falls back to slow PyTorch code when either is
missing: the kernel roles and install hints below are what ``targets/fast_path.py`` checks and prints. Qwen3.5-MoE has no dense ``intermediate_size``: the drafter's MLP
takes its active width (``moe.mlp_width``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from dflash_dist.targets.families import dense, hybrid_packing, moe
from dflash_dist.targets.families.base import cfg_get
from dflash_dist.targets.families.dense import DEFAULT

# class-name markers of linear-attention layers that need external kernels
LINEAR_LAYER_MARKERS = ("GatedDeltaNet",)

# kernel role -> (package import name, names to look for: layer attribute / module global, in order)
KERNEL_ROLES: dict = {
    "chunk_gated_delta_rule": ("fla", ("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule")),
    "fused_recurrent_gated_delta_rule": ("fla", ("recurrent_gated_delta_rule", "fused_recurrent_gated_delta_rule",
                                                 "torch_recurrent_gated_delta_rule")),
    "causal_conv1d_fn": ("causal_conv1d", ("causal_conv1d_fn",)),
    "causal_conv1d_update": ("causal_conv1d", ("causal_conv1d_update", "torch_causal_conv1d_update")),
}
# what the target's prefill (a forward without cache) calls: these decide "bound"
PREFILL_ROLES = {"fla": "chunk_gated_delta_rule", "causal_conv1d": "causal_conv1d_fn"}

INSTALL_HINTS = {
    "fla": ("flash-linear-attention is missing: `pip install flash-linear-attention` (imports as `fla`; needs "
            "triton and a GPU). Without it the GatedDeltaNet layers run transformers' PyTorch reference "
            "(chunk_gated_delta_rule), several times slower."),
    "causal_conv1d": ("causal-conv1d is missing: it is source-only on the registry; build it for your GPU against "
                      "the installed torch: `pip download --no-deps --no-binary=:all: --no-build-isolation "
                      "causal-conv1d==1.7.0 -d DIR`, then `bash docker/build_causal_conv1d.sh DIR/causal_conv1d-1.7.0.tar.gz "
                      "TARGET_DIR sm_90` and put TARGET_DIR on PYTHONPATH (docker/Dockerfile does the same for its image), or "
                      "`pip install causal-conv1d --no-build-isolation` (builds every architecture: slow). "
                      "Measured: 1.16x faster prefill of a Qwen3-Next-shaped target with it."),
}

# layer kinds a hybrid runs packed: softmax attention as dense targets, GatedDeltaNet through the varlen kernels
PACKABLE_LAYER_TYPES = (*dense.PACKABLE_LAYER_TYPES, "linear_attention")


def packing_problem(tc: Any, layers: Optional[list]) -> Optional[str]:
    """The dense rule for the attention layers; the linear-attention layers need the fast kernels' varlen forms:
    importable (config only, before weights load), then bound and taking the boundaries (built layers)."""
    problem = dense.packing_problem(tc, layers, PACKABLE_LAYER_TYPES)
    if problem:
        return problem
    if layers is None:
        kinds = cfg_get(tc, "layer_types") or []
        problem = hybrid_packing.config_problem() if "linear_attention" in kinds else None
        first = kinds.index("linear_attention") if problem else 0
        return f"decoder layer {first} is linear_attention (GatedDeltaNet): {problem}" if problem else None
    problem = hybrid_packing.varlen_problem(layers)
    if problem:
        first = next(i for i, layer in enumerate(layers) if hasattr(layer, "linear_attn"))
        return f"decoder layer {first} ({type(layers[first]).__name__}) has linear attention (GatedDeltaNet): {problem}"
    return None


_HYBRID = replace(DEFAULT, linear_layer_markers=LINEAR_LAYER_MARKERS, mlp_width=moe.mlp_width,
                  packing_problem=packing_problem)

FAMILIES = (
    replace(_HYBRID, name="qwen3_next", model_types=("qwen3_next",)),
    replace(_HYBRID, name="qwen3_5", model_types=("qwen3_5", "qwen3_5_text")),
    replace(_HYBRID, name="qwen3_5_moe", model_types=("qwen3_5_moe", "qwen3_5_moe_text")),
)
