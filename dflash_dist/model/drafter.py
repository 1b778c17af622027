"""The DFlash drafter: Qwen3-style decoder layers whose keys/values are [target features | block tokens].

Parameter names follow the z-lab ``DFlashDraftModel`` checkpoint layout (``layers.{i}.self_attn.q_proj`` ...,
``fc``, ``hidden_norm``, ``norm``) so exported state dicts load in vLLM/SGLang unchanged. There is no
embedding and no lm_head: both are the target's, frozen, and applied by the caller.

Per step::

    ctx = hidden_norm(fc(features))                       # [b, S, H], once, shared by all layers
    h   = block_embeds                                    # [b, Q, H]
    per layer:  x = input_layernorm(h)
                q = rope(q_norm(q_proj(x)), block_positions)
                k = rope(k_norm([k_proj(ctx) | k_proj(x)]), [ctx_positions | block_positions])
                v = [v_proj(ctx) | v_proj(x)]
                h = h + o_proj(attn(q, k, v, mask));  h = h + mlp(post_attention_layernorm(h))
    return norm(h)

The context is projected by the same layer's k_proj/v_proj but not input-normed (hidden_norm already did).

Backends: ``flex`` (module-level compiled flex_attention + a BlockMask built once per step by
``masks.flex_block_mask``) and ``sdpa`` (dense bool mask [b, Q, K]; needed on CPU, where flex has no
backward). Fully masked rows (padding blocks) give exactly 0 attention output on both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash_dist.config import ConfigError
from dflash_dist.config.drafter import check_flex_backend
from dflash_dist.targets.families import family_for
from dflash_dist.model.lazy_compile import lazy_compile
from dflash_dist.model.masks import window_mask
from dflash_dist.model.rope import DrafterRope, drafter_rope_parameters

__all__ = ["DrafterModelConfig", "DFlashDrafter", "RMSNorm", "rotary_cos_sin", "apply_rotary"]

# Compiled once per process; flex_attention must never run uncompiled (the eager path materialises the
# full score matrix). fullgraph: a graph break here would silently fall back to that path.
# Static shapes (CPU, or drafter.tuning.compile_dynamic=false) and dynamic shapes (CUDA default: one Triton kernel for
# every (b, S_pad); a static compile per new shape costs tens of seconds, the dynamic kernel reads the sizes
# at run time). CPU cannot use the dynamic one: inductor's C++ flex template fails to build (torch 2.13).
# Both compile on their first call (lazy_compile): the sdpa path never imports dynamo.
flex_attention_compiled = lazy_compile(flex_attention, fullgraph=True)
_flex_attention_compiled_dynamic = lazy_compile(flex_attention, fullgraph=True, dynamic=True)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


@dataclass
class DrafterModelConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    num_feature_layers: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    vocab_size: int          # not used by the module (no lm_head); kept for the exported config
    max_position_embeddings: int
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    layer_types: Optional[list] = None   # per layer "full_attention" / "sliding_attention"; None: all full
    sliding_window: Optional[int] = None  # the window W of the sliding_attention layers (masks.py: |q - k| < W)
    # transformers 5 rope_parameters of the drafter (rope_type, rope_theta, scaling fields; model/rope.py);
    # None: default RoPE with rope_theta (checkpoints written before RoPE scaling was supported)
    rope_parameters: Optional[dict] = None
    # a variant's own settings (its ``model_settings``: e.g. drafter.domino, drafter.dflash2); None: it has none
    variant_settings: Optional[dict] = None

    def __post_init__(self) -> None:
        if self.layer_types is not None:
            self.layer_types = [str(t) for t in self.layer_types]
            bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
            if bad or len(self.layer_types) != self.num_layers:
                raise ConfigError(f"layer_types={self.layer_types}: need {self.num_layers} entries, each "
                                  "full_attention or sliding_attention")
        sliding = "sliding_attention" in (self.layer_types or [])
        if sliding and (self.sliding_window is None or int(self.sliding_window) < 1):
            raise ConfigError(f"sliding_attention layers need sliding_window >= 1, got {self.sliding_window}")
        if self.sliding_window is not None:
            if not sliding:
                raise ConfigError(f"sliding_window={self.sliding_window} but no layer is sliding_attention")
            self.sliding_window = int(self.sliding_window)
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act={self.hidden_act!r}: the drafter implements silu only")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_parameters is not None:
            self.rope_parameters = dict(self.rope_parameters)
            theta = self.rope_parameters.setdefault("rope_theta", self.rope_theta)
            self.rope_parameters.setdefault("rope_type", "default")
            if float(theta) != float(self.rope_theta):
                raise ValueError(f"rope_theta={self.rope_theta} but rope_parameters['rope_theta']={theta}")

    def rope_params(self) -> dict:
        """The drafter's rope_parameters (default RoPE with rope_theta when none were given)."""
        return dict(self.rope_parameters or {"rope_type": "default", "rope_theta": float(self.rope_theta)})

    @staticmethod
    def from_target(hf_config: Any, *, num_layers: int, num_feature_layers: int, block_size: int,
                    intermediate_size: Optional[int] = None, layer_types: Optional[list] = None,
                    sliding_window: Optional[int] = None) -> "DrafterModelConfig":
        """Copy the Qwen3/LLaMA fields of the target's HF config (object or dict).

        RoPE: the target's rope type, theta and scaling (``rope.drafter_rope_parameters``: every rope type
        transformers implements); not its ``partial_rotary_factor`` or M-RoPE sections: the drafter is exported as
        a Qwen3, which rotates whole heads with 1-D positions (see model/rope.py).
        """
        if not isinstance(hf_config, dict) and hasattr(hf_config, "get_text_config"):
            hf_config = hf_config.get_text_config()
        family = family_for(hf_config)
        problem = family.drafter_refusal(hf_config)
        if problem:
            raise ConfigError(f"target family cannot be mirrored by the DFlash drafter: {problem}")
        hidden = int(_cfg_get(hf_config, "hidden_size"))
        heads = int(_cfg_get(hf_config, "num_attention_heads"))
        kv_heads = _cfg_get(hf_config, "num_key_value_heads") or heads
        head_dim = _cfg_get(hf_config, "head_dim") or hidden // heads
        rope = drafter_rope_parameters(hf_config)
        theta = rope["rope_theta"]
        return DrafterModelConfig(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            intermediate_size=int(intermediate_size or family.drafter_intermediate(hf_config)),
            num_layers=int(num_layers),
            num_feature_layers=int(num_feature_layers),
            rms_norm_eps=float(_cfg_get(hf_config, "rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            block_size=int(block_size),
            vocab_size=int(_cfg_get(hf_config, "vocab_size")),
            max_position_embeddings=int(_cfg_get(hf_config, "max_position_embeddings", 32768)),
            hidden_act=str(_cfg_get(hf_config, "hidden_act", "silu")),
            initializer_range=float(_cfg_get(hf_config, "initializer_range", 0.02) or 0.02),
            layer_types=list(layer_types) if layer_types is not None else None,
            sliding_window=sliding_window,
            rope_parameters=rope,
        )

    @property
    def kinds(self) -> list:
        """Attention kind of every layer (``layer_types``, all ``full_attention`` when None)."""
        return list(self.layer_types) if self.layer_types is not None else ["full_attention"] * self.num_layers


class RMSNorm(nn.Module):
    """Qwen3RMSNorm semantics: variance in fp32, normalise, cast back, then scale by ``weight`` (init 1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def rotary_cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype, attention_scaling: float = 1.0
                   ) -> tuple[Tensor, Tensor]:
    """cos/sin [..., head_dim] for integer positions (rotate_half layout: frequencies repeated twice), times
    transformers' ``attention_scaling`` (yarn, longrope)."""
    freqs = positions.float()[..., None] * inv_freq.float()
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [b, heads, L, d]; cos/sin [b, L, d] (broadcast over heads)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def default_flex_kernel_options(device: torch.device) -> dict:
    """The flex tile options when ``drafter.tuning.flex_kernel_options`` is null: inductor's defaults, with the
    forward's loads through TMA on GPUs that have it (sm90+). On an H200, 0.7-1.5% faster steps from 3K to 32K
    contexts than without it (measured: docs/benchmarks.md#long-context-mask; its host work shows in short steps
    timed alone); the backward's TMA was not faster (docs/benchmarks.md#drafter-step-profile)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        return {"fwd_USE_TMA": True}
    return {}


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DrafterModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.scaling = d ** -0.5
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.flex_dynamic = False  # set by DFlashDrafter.configure_compile
        self.flex_kernel_options: Optional[dict] = None  # idem (drafter.tuning.flex_kernel_options)

    def forward(self, x: Tensor, ctx: Tensor, rope_q: tuple[Tensor, Tensor], rope_k: tuple[Tensor, Tensor],
                mask: Any, backend: str) -> Tensor:
        b, q_len, _ = x.shape
        d = self.head_dim
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, d)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)                  # [b, S+Q, H]: context first, then block tokens
        k = self.k_norm(self.k_proj(kv_in).view(b, -1, self.num_kv_heads, d)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, -1, self.num_kv_heads, d).transpose(1, 2)
        q = apply_rotary(q, *rope_q)
        k = apply_rotary(k, *rope_k)
        if backend == "flex":
            flex = _flex_attention_compiled_dynamic if self.flex_dynamic else flex_attention_compiled
            out = flex(q, k, v, block_mask=mask, scale=self.scaling, enable_gqa=True,
                       kernel_options=self.flex_kernel_options)
        else:
            attn_mask, row_ok = mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scaling,
                                                 enable_gqa=self.num_heads != self.num_kv_heads)
            out = out * row_ok
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * d))


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DrafterModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterModelConfig):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = DFlashMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: Tensor, ctx: Tensor, rope_q, rope_k, mask, backend: str) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx, rope_q, rope_k, mask, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """DFlash draft model. ``forward`` returns normed hidden states [b, Q, H]; apply the target lm_head.

    A drafter variant (model/variants/) subclasses it and overrides what differs: ``make_layer`` (replace or wrap
    a decoder layer: weights inside the layers), ``add_modules`` and ``after_layers`` (modules after the
    layers), ``propose`` (a block's proposals from its final hidden states), ``loss_terms`` (its own losses)."""

    loss_term_names: tuple = ()
    """The names of ``loss_terms`` (each a step statistic; the trainer declares them before the first step)."""

    head_topk: int = 0
    """Top-K head ids per loss row that ``loss_terms`` reads (``context["head_topk_ids"]``) when the objective's
    fused pass gives them; 0: none."""

    def __init__(self, cfg: DrafterModelConfig, backend: str):
        super().__init__()
        if backend not in ("flex", "sdpa"):
            raise ValueError(f"backend={backend!r}: use 'flex' or 'sdpa'")
        self.config = cfg
        self.backend = backend
        h = cfg.hidden_size
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        self.fc = nn.Linear(cfg.num_feature_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.add_modules(cfg)
        self.attention_calls: dict = {"flex_compiled": 0, "sdpa": 0, "flex_dynamic": 0, "compiled_layers": 0}
        self.flex_dynamic = False
        self.flex_kernel_options: Optional[dict] = None
        self.compiled_layers = False
        self._layer_fns = list(self.layers)
        self.rope = DrafterRope(cfg.rope_params(), head_dim=cfg.head_dim, hidden_size=h,
                                num_attention_heads=cfg.num_attention_heads,
                                max_position_embeddings=cfg.max_position_embeddings)
        self.reset_parameters()

    # ---- what a variant overrides
    def make_layer(self, cfg: DrafterModelConfig, index: int) -> nn.Module:
        """Decoder layer ``index``: ``layer(h, ctx, rope_q, rope_k, mask, backend) -> h``, with a ``self_attn``
        (DFlashAttention) the compile settings reach."""
        return DFlashDecoderLayer(cfg)

    def add_modules(self, cfg: DrafterModelConfig) -> None:
        """Modules beside fc / norms (a variant's weights after the layers); initialised by reset_parameters."""

    def after_layers(self, h: Tensor) -> Tensor:
        """Final hidden states [b, Q, H] from the last layer's output."""
        return self.norm(h)

    def propose(self, hidden: Tensor, lm_head: Tensor, anchor_ids: Optional[Tensor] = None) -> Tensor:
        """A block's proposals [b, B-1] from its final hidden states [b, B, H], the target head [V, H] and the
        anchor tokens [b]: DFlash proposes the argmax of the unary logits of slots 1..B-1."""
        head = lm_head.to(hidden.device)
        return F.linear(hidden[:, 1:].to(head.dtype), head).argmax(-1)

    def set_context(self, **context: Any) -> None:
        """What a variant's ``loss_terms`` / ``propose`` may read beyond their arguments, set by their caller just
        before: the trainer passes ``group`` (the DrafterBatch), ``embed`` (the target's [V, H]), ``objective``,
        ``step`` (optimizer steps taken), ``total_steps`` (the run's optimizer steps in all) and
        ``head_topk_ids`` (``LossParts.topk_ids``); evaluation passes ``block_ids`` and ``embed``."""
        self.context = context

    def loss_terms(self, hidden: Tensor, labels: Tensor, lm_head: Tensor, block_ids: Optional[Tensor] = None,
                   row_weights: Optional[Tensor] = None) -> dict:
        """A variant's own loss sums {name: fp32 scalar with its graph} for a group (hidden [b, N*B, H], labels and
        block_ids [b, N*B], row_weights: the objective's detached weights of slots 1..B-1 in block order); those
        named in ``loss_term_names`` are added to the objective's loss sum and normalised with it, the others are
        statistics of ``stat_slots``. DFlash: none."""
        return {}

    def stat_slots(self) -> dict:
        """Named statistics (name -> size) of ``loss_terms`` beyond the loss terms; DFlash: none."""
        return {}

    def window_metrics(self, sums: dict) -> dict:
        """Logged metrics from a window's all-reduced sums of the statistics; DFlash: none."""
        return {}

    def configure_compile(self, flex_dynamic: bool = False, compile_layers: bool = False,
                          kernel_options: Optional[dict] = None) -> "DFlashDrafter":
        """flex_dynamic: use the dynamic-shape compiled flex kernel (CUDA). compile_layers: run each decoder layer
        through torch.compile (fullgraph; the flex call is traced into the layer's graph), so the norms, RoPE and
        the SiLU gate fuse. All layers share one code object, so they share the compiled graph. kernel_options:
        flex_attention tile options (drafter.tuning.flex_kernel_options): None = ``default_flex_kernel_options`` for
        the device the parameters are on, {} = inductor's defaults."""
        # the config refuses compiled layers on sdpa (config.drafter_backend); sdpa is the uncompiled reference
        assert not compile_layers or self.backend == "flex", "compiled layers need the flex backend"
        self.flex_dynamic = bool(flex_dynamic)
        device = next(self.parameters()).device
        if kernel_options is None:
            kernel_options = default_flex_kernel_options(device)
        if self.backend == "flex":
            check_flex_backend(kernel_options, device)
        self.flex_kernel_options = dict(kernel_options) or None
        for layer in self.layers:
            layer.self_attn.flex_dynamic = self.flex_dynamic
            layer.self_attn.flex_kernel_options = self.flex_kernel_options
        self.compiled_layers = bool(compile_layers)
        if compile_layers:
            # Each layer is its own small graph, so DDP's graph splitting (dynamo's DDPOptimizer, which cuts a
            # graph at gradient-bucket boundaries) buys nothing, and it fails on graphs that hold the flex HOP
            # (an inductor AssertionError in the split submodules, seen on torch 2.11 CUDA and 2.13 CPU).
            import torch._dynamo
            import torch._inductor.config
            torch._dynamo.config.optimize_ddp = False
            # inductor's coalescing analysis asserts on these layers' fused reductions once the batch size is
            # symbolic (tiling_utils.get_pw_red_splits, torch 2.11 CUDA, b > 1 with dynamic shapes); it only
            # picks tilings, so turning it off changes speed heuristics, not results
            if hasattr(torch._inductor.config.triton, "coalesce_tiling_analysis"):
                torch._inductor.config.triton.coalesce_tiling_analysis = False
            # torch < 2.13: inductor's mix-order reduction (the RMSNorm backward's fused weight-gradient sum)
            # writes its final slice as `ws[i * n + m * r : ...]` without parentheses; when the split count is a
            # symbolic sum (k_norm over [context | block] rows, b > 1) the view fails at run time ("shape
            # '[1280, 128]' is invalid for input of size 1024", torch 2.11 on an H200). torch 2.13 parenthesises.
            if _torch_version() < (2, 13) and hasattr(torch._inductor.config.triton, "mix_order_reduction"):
                torch._inductor.config.triton.mix_order_reduction = False
        self._layer_fns = ([torch.compile(layer, fullgraph=True, dynamic=True if self.flex_dynamic else None)
                            for layer in self.layers] if compile_layers else list(self.layers))
        return self

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """HF init: Linear weights ~ N(0, initializer_range), RMSNorm weights 1."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, self.config.initializer_range)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)

    def inv_freq(self, device, seq_len: Optional[int] = None) -> Tensor:
        """RoPE inverse frequencies, fp32, from transformers' init function for the drafter's rope parameters
        (model/rope.py); not a buffer: .to(dtype) would cast it to bf16. ``seq_len``: for the length-dependent
        types (dynamic, longrope)."""
        return self.rope.inv_freq_on(device, seq_len)

    def rotary(self, ctx_positions: Tensor, block_positions: Tensor, dtype: torch.dtype
               ) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """((cos, sin) of the block queries [b, Q, d], (cos, sin) of the keys [b, S+Q, d]: context then block)."""
        seq_len = None
        if self.rope.depends_on_length:  # one host sync, only for dynamic / longrope
            seq_len = int(max(ctx_positions.max(), block_positions.max())) + 1
        inv_freq = self.inv_freq(block_positions.device, seq_len)
        scale = self.rope.attention_scaling
        rope_q = rotary_cos_sin(block_positions, inv_freq, dtype, scale)
        rope_c = rotary_cos_sin(ctx_positions, inv_freq, dtype, scale)
        return rope_q, (torch.cat([rope_c[0], rope_q[0]], dim=1), torch.cat([rope_c[1], rope_q[1]], dim=1))

    def _prepare_masks(self, mask: Any, b: int, q_len: int, k_len: int, ctx_positions: Tensor,
                       block_positions: Tensor) -> dict:
        """{attention kind: prepared mask} for the kinds this drafter's layers use. ``mask`` is one mask (every
        layer full attention) or ``{kind: mask}`` (``masks.layer_masks``). Given one dense mask, the sdpa backend
        derives the sliding layers' mask from positions (``masks.window_mask``); flex needs the dict."""
        kinds = set(self.config.kinds)
        if not isinstance(mask, dict):
            if kinds == {"full_attention"}:
                return {"full_attention": self._prepare_mask(mask, b, q_len, k_len)}
            if self.backend == "flex":
                raise TypeError("this drafter has sliding_attention layers: pass {kind: BlockMask} "
                                "(masks.layer_masks with flex_block_mask(..., sliding_window=W))")
            self._prepare_mask(mask, b, q_len, k_len)  # type/shape check of the full mask
            k_pos = torch.cat([ctx_positions, block_positions], dim=1)
            mask = {"full_attention": mask,
                    "sliding_attention": mask & window_mask(block_positions, k_pos, self.config.sliding_window)}
        missing = sorted(kinds - set(mask))
        if missing:
            raise ValueError(f"no mask for the {missing} layers (got masks for {sorted(mask)})")
        return {k: self._prepare_mask(mask[k], b, q_len, k_len) for k in kinds}

    def _prepare_mask(self, mask: Any, b: int, q_len: int, k_len: int) -> Any:
        if self.backend == "flex":
            if not isinstance(mask, BlockMask):
                raise TypeError(f"flex backend needs a BlockMask (masks.flex_block_mask), got {type(mask).__name__}")
            if tuple(mask.seq_lengths) != (q_len, k_len):
                raise ValueError(f"BlockMask built for {tuple(mask.seq_lengths)}, attention is {(q_len, k_len)}")
            return mask
        if not (isinstance(mask, Tensor) and mask.dtype == torch.bool and mask.shape == (b, q_len, k_len)):
            raise TypeError(f"sdpa backend needs a bool mask [b, Q, K] = {(b, q_len, k_len)} (masks.dense_mask)")
        # SDPA returns NaN for rows with no visible key (padding blocks). Let such rows see key 0, then zero
        # their output with row_ok: the result is exactly 0 and the gradient through the row is 0, not NaN.
        row_ok = mask.any(-1)                                              # [b, Q]
        attn_mask = mask.clone()
        attn_mask[..., 0] |= ~row_ok
        return attn_mask[:, None], row_ok[:, None, :, None]

    def _fc_input(self, features: Tensor) -> Tensor:
        """The features as fc takes them: in the weights' dtype, except under autocast to the features' own dtype
        (bf16 features on CUDA), where a cast up and autocast's cast back would copy [S, 5H] twice for the same
        bits."""
        dev = features.device.type
        if torch.is_autocast_enabled(dev) and features.dtype == torch.get_autocast_dtype(dev):
            return features
        return features.to(self.fc.weight.dtype)

    def forward(self, block_embeds: Tensor, features: Tensor, ctx_positions: Tensor, block_positions: Tensor,
                mask: Any) -> Tensor:
        """block_embeds [b, Q, H] (target embedding of block_ids), features [b, S, n*H], ctx_positions [b, S],
        block_positions [b, Q], mask: BlockMask (flex) or bool [b, Q, S+Q] (sdpa), or ``{layer kind: mask}`` for
        a drafter with sliding_attention layers (see ``_prepare_masks``). Returns [b, Q, H]."""
        b, q_len, _ = block_embeds.shape
        masks = self._prepare_masks(mask, b, q_len, features.shape[1] + q_len, ctx_positions, block_positions)
        ctx = self.hidden_norm(self.fc(self._fc_input(features)))
        h = block_embeds.to(ctx.dtype)
        rope_q, rope_k = self.rotary(ctx_positions, block_positions, h.dtype)
        for kind, layer in zip(self.config.kinds, self._layer_fns):
            h = layer(h, ctx, rope_q, rope_k, masks[kind], self.backend)
        # counted here, outside any compiled region (a counter mutated inside one would become a guard)
        n = len(self.layers)
        self.attention_calls["flex_compiled" if self.backend == "flex" else "sdpa"] += n
        self.attention_calls["flex_dynamic"] += n if self.backend == "flex" and self.flex_dynamic else 0
        self.attention_calls["compiled_layers"] += n if self.compiled_layers else 0
        return self.after_layers(h)
