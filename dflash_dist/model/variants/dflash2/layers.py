"""DFlash2 decoder layers: the DFlash layer with a grouped dynamic causal convolution around attention and MLP.

The layout vLLM (``DFlash2DraftModel``) and SGLang (``DFLASH``) load. Per layer::

    x, d = attention_conv.prepare(input_layernorm(h))      # convolve the attention input, keep the output kernel
    h    = h + attention_conv.finish(self_attn(x, ctx), d)
    x, d = mlp_conv.prepare(post_attention_layernorm(h))
    h    = h + mlp_conv.finish(mlp(x), d)

The context keys/values (``ctx``) get no convolution. The convolution is causal along the position in the block
only (the flattened query index mod B): a tap never reaches into the previous block or the context. At init it
is the identity (tap 0 = 1, other taps 0, projection 0), so a fresh DFlash2 layer computes the DFlash layer.

The candidate selector after the layers is ``selector.py``; this module also holds the settings, the
FLOP counts and the export contract (config fields, weight names and shapes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dflash_dist.config import ConfigError, DrafterDFlash2
from dflash_dist.model.variants.dflash2.selector import CandidateSelector
from dflash_dist.model.drafter import DFlashDecoderLayer, DrafterModelConfig

__all__ = ["ARCHITECTURE", "DFlash2Settings", "GroupedDynamicConv", "DFlash2DecoderLayer", "reset_dflash2_parameters",
           "conv_flops_per_row", "selector_flops_per_row", "export_fields", "expected_shapes"]

# The architecture string both engines key DFlash2 on (vLLM: ``_is_dflash2_draft``; SGLang builds the selector
# only for this class name)
ARCHITECTURE = "DFlash2DraftModel"

# drafter.dflash2 fields that set how the step computes, not what the drafter is: left out of the checkpoint
# identity (a run resumes with either value) and of the export
STEP_SETTINGS = ("conv_dtype",)


@dataclass
class DFlash2Settings(DrafterDFlash2):
    """The DFlash2 additions to the DFlash drafter (exported under ``dflash_config``): the fields of
    ``drafter.dflash2`` (``config.DrafterDFlash2``, where each is documented), with their values checked and
    normalised, and ``check_model`` against the drafter's shape."""

    def __post_init__(self) -> None:
        super().__post_init__()  # the choices
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if int(getattr(self, key)) < 1:
                raise ConfigError(f"drafter.dflash2.{key}={getattr(self, key)}: must be >= 1")
            setattr(self, key, int(getattr(self, key)))
        if not 0 < float(self.output_multiplier) < math.inf:
            raise ConfigError(f"drafter.dflash2.output_multiplier={self.output_multiplier}: must be finite and > 0 "
                              "(SGLang refuses anything else)")
        cap = self.final_logit_softcapping
        if cap is not None and not 0 <= float(cap) < math.inf:
            raise ConfigError(f"drafter.dflash2.final_logit_softcapping={cap}: use a positive cap, or 0/null for off")
        self.final_logit_softcapping = float(cap) if cap else None
        if float(self.selector_loss_weight) < 0:
            raise ConfigError(f"drafter.dflash2.selector_loss_weight={self.selector_loss_weight}: must be >= 0")

    def check_model(self, hidden_size: int, block_size: int, vocab_size: int) -> None:
        """Refuse settings this drafter shape cannot hold."""
        if hidden_size % self.conv_group_size:
            raise ConfigError(f"drafter.dflash2.conv_group_size={self.conv_group_size} does not divide the hidden "
                              f"size {hidden_size}")
        if self.conv_kernel_size > block_size:
            raise ConfigError(f"drafter.dflash2.conv_kernel_size={self.conv_kernel_size} exceeds the block size "
                              f"{block_size}")
        if self.selector_top_k > vocab_size:
            raise ConfigError(f"drafter.dflash2.selector_top_k={self.selector_top_k} exceeds the vocabulary "
                              f"{vocab_size}")


class GroupedDynamicConv(nn.Module):
    """Input-side and output-side causal convolutions of one sublayer, both driven by the sublayer's input.

    ``base_kernel`` [2, k, H] (side 0 = input, 1 = output); ``kernel_projection`` H -> 2*k*G gives per-token
    deltas, one per group of g channels: coef[t, tap, c] = base_kernel[side, tap, c] + delta[t, side, tap, c // g].
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ConfigError(f"conv_group_size={group_size} does not divide the hidden size {hidden_size}")
        self.kernel_size, self.group_size = int(kernel_size), int(group_size)
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Identity: tap 0 = 1, the other taps 0, no dynamic part."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, x: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
        """x [b, Q, H] (Q a multiple of block_size) -> (x convolved with the input side, output-side deltas
        [b, Q, k, G] for ``finish``)."""
        delta = self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, self.num_groups))
        return self._conv(x, delta[..., 0, :, :], 0, block_size), delta[..., 1, :, :]

    def finish(self, y: Tensor, delta_out: Tensor, block_size: int) -> Tensor:
        """The sublayer's output y [b, Q, H] convolved with the output side (deltas from ``prepare``)."""
        return self._conv(y, delta_out, 1, block_size)

    def _conv(self, x: Tensor, delta: Tensor, side: int, block_size: int) -> Tensor:
        """out[t] = sum_tap coef[t, tap] * x[t - tap], a tap zeroed where the position in block is < tap.
        One pass per tap over [b, Q, G, g] views: no loop over positions, static shapes, no host sync."""
        q_len, hidden = x.shape[-2], x.shape[-1]
        if q_len % block_size:
            raise ValueError(f"{q_len} query rows are not whole blocks of {block_size}")
        pos = torch.arange(q_len, device=x.device) % block_size                  # [Q]
        xg = x.unflatten(-1, (self.num_groups, self.group_size))                  # [..., Q, G, g]
        base = self.base_kernel[side].to(x.dtype).view(self.kernel_size, self.num_groups, self.group_size)
        delta = delta.to(x.dtype)
        out = xg * (base[0] + delta[..., 0, :, None])
        for tap in range(1, self.kernel_size):
            # shift by tap rows along Q (zeros in front), then drop the rows whose tap would cross a block start
            shifted = torch.cat([xg.new_zeros(*xg.shape[:-3], tap, *xg.shape[-2:]), xg[..., :-tap, :, :]], dim=-3)
            keep = (pos >= tap).to(x.dtype)[:, None, None]                        # [Q, 1, 1]
            out = out + shifted * (base[tap] + delta[..., tap, :, None]) * keep
        return out.reshape(*x.shape[:-1], hidden)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """``DFlashDecoderLayer`` (same attention, MLP and norms) with ``attention_conv`` and ``mlp_conv``; the same
    forward signature, so it can stand wherever a DFlash layer does. The block size is the drafter's."""

    def __init__(self, cfg: DrafterModelConfig, settings: DFlash2Settings):
        super().__init__(cfg)
        settings.check_model(cfg.hidden_size, cfg.block_size, cfg.vocab_size)
        self.block_size = int(cfg.block_size)
        k, g = settings.conv_kernel_size, settings.conv_group_size
        self.attention_conv = GroupedDynamicConv(cfg.hidden_size, k, g)
        self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, k, g)
        self.conv_in_compute_dtype = settings.conv_dtype == "compute"

    def forward(self, h: Tensor, ctx: Tensor, rope_q, rope_k, mask, backend: str) -> Tensor:
        x, d = self.attention_conv.prepare(self._conv_input(self.input_layernorm(h)), self.block_size)
        a = self.self_attn(x, ctx, rope_q, rope_k, mask, backend)   # the context's keys/values: no conv
        h = h + self.attention_conv.finish(a, d, self.block_size)
        x, d = self.mlp_conv.prepare(self._conv_input(self.post_attention_layernorm(h)), self.block_size)
        return h + self.mlp_conv.finish(self.mlp(x), d, self.block_size)

    def _conv_input(self, x: Tensor) -> Tensor:
        """``drafter.dflash2.conv_dtype=compute``: the normed input in autocast's dtype before the convolution (the
        kernel projection and the q/k/v or MLP projections would take it in that dtype anyway)."""
        dev = x.device.type
        if self.conv_in_compute_dtype and torch.is_autocast_enabled(dev):
            return x.to(torch.get_autocast_dtype(dev))
        return x


def reset_dflash2_parameters(model: nn.Module, initializer_range: float = 0.02) -> None:
    """The DFlash2 init of every conv and selector inside ``model``. Call it after a generic init (the drafter's
    N(0, std) over all Linear weights would make the convs non-identity and the successor codebook non-zero)."""
    for m in model.modules():
        if isinstance(m, GroupedDynamicConv):
            m.reset_parameters()
        elif isinstance(m, CandidateSelector):
            m.reset_parameters(initializer_range)


def conv_flops_per_row(hidden_size: int, settings: DFlash2Settings) -> dict:
    """Forward FLOPs of one layer's two convs (attention_conv, mlp_conv) per query row, 2 per multiply-add:
    the kernel projection (H -> 2kG) and, per side, the coefficient adds (k*H) and the tap multiply-adds (2k*H).
    The projection is a trainable matmul (x3 with backward, as telemetry/flops.py counts matmuls)."""
    k, g = settings.conv_kernel_size, settings.conv_group_size
    projection = 2 * (2.0 * hidden_size * 2 * k * (hidden_size // g))       # two convs per layer
    taps = 2 * 2 * (k * hidden_size + 2.0 * k * hidden_size)                # two convs x two sides
    return {"matmul": projection, "elementwise": taps}


def selector_flops_per_row(hidden_size: int, settings: DFlash2Settings, predecessors: int = 1,
                           unary_recompute: bool = True) -> dict:
    """Forward FLOPs of the selector per scored row: the hidden projection (2*H*r, a trainable matmul), the
    predecessor codebook rows times the projection (r per predecessor), the K-way bilinear dots (2*K*r per
    predecessor) and, in training, the unary logits of the K candidates from the gathered head rows (2*K*H;
    ``unary_recompute``). ``predecessors``: 1 in training (teacher forced), K in the decoding lattice."""
    r, k = settings.selector_rank, settings.selector_top_k
    matmul = 2.0 * hidden_size * r
    gathered = predecessors * (r + 2.0 * k * r) + (2.0 * k * hidden_size if unary_recompute else 0.0)
    return {"matmul": matmul, "gathered": gathered}


def export_fields(settings: DFlash2Settings) -> dict:
    """The ``dflash_config`` fields of the DFlash2 additions. vLLM reads the first four with ``[]`` (KeyError when
    missing); the cap is written as 0.0 when off (both engines read 0 or null as off). No
    ``input_embedding_scale``: SGLang ignores it, so only its default 1.0 serves alike on both engines."""
    return {"conv_kernel_size": settings.conv_kernel_size, "conv_group_size": settings.conv_group_size,
            "selector_rank": settings.selector_rank, "selector_top_k": settings.selector_top_k,
            "output_multiplier": float(settings.output_multiplier),
            "final_logit_softcapping": float(settings.final_logit_softcapping or 0.0)}


def expected_shapes(mc: DrafterModelConfig, settings: DFlash2Settings, attention_bias: bool = False
                    ) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of a DFlash2 ``model.safetensors`` (no ``model.`` prefix, no embed_tokens or
    lm_head: both are the target's; the codebooks have no ``.weight`` suffix)."""
    h, d, v, r = mc.hidden_size, mc.head_dim, mc.vocab_size, settings.selector_rank
    qd, kvd, k = mc.num_attention_heads * d, mc.num_key_value_heads * d, settings.conv_kernel_size
    groups = h // settings.conv_group_size
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (h, mc.num_feature_layers * h), "hidden_norm.weight": (h,),
                                          "norm.weight": (h,)}
    for i in range(mc.num_layers):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (qd, h), p + "self_attn.k_proj.weight": (kvd, h),
                       p + "self_attn.v_proj.weight": (kvd, h), p + "self_attn.o_proj.weight": (h, qd),
                       p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                       p + "mlp.gate_proj.weight": (mc.intermediate_size, h),
                       p + "mlp.up_proj.weight": (mc.intermediate_size, h),
                       p + "mlp.down_proj.weight": (h, mc.intermediate_size)})
        if attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (qd,), p + "self_attn.k_proj.bias": (kvd,),
                           p + "self_attn.v_proj.bias": (kvd,), p + "self_attn.o_proj.bias": (h,)})
        for conv in ("attention_conv", "mlp_conv"):
            shapes[p + f"{conv}.base_kernel"] = (2, k, h)
            shapes[p + f"{conv}.kernel_projection.weight"] = (2 * k * groups, h)
    shapes.update({"candidate_selector.hidden_projection.weight": (r, h),
                   "candidate_selector.predecessor_codebook": (v, r),
                   "candidate_selector.successor_codebook": (v, r)})
    return shapes
