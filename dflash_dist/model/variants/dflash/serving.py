"""DFlash draft model for ``AutoModel.from_pretrained(export_dir, trust_remote_code=True)``.

dflash-export copies this file into every export (``auto_map: {"AutoModel": "modeling_dflash.DFlashDraftModel"}``).
It is standalone: torch and transformers only (transformers 4.57, which the z-lab reference pins, and 5.x), no
dflash_dist import. It computes what dflash_dist's ``DFlashDrafter`` computes with its sdpa backend, operation for
operation (tests/unit/checkpoint/test_export.py checks identical outputs); keep the two in step.

Call (the z-lab ``DFlashDraftModel`` signature)::

    hidden = model(position_ids=pos, noise_embedding=target.embed_tokens(block_ids), target_hidden=features)
    logits = target.lm_head(hidden)

``target_hidden`` [b, S, n*H]: the target's hidden states after each layer in ``dflash_config.target_layer_ids``
(HF ``hidden_states[i + 1]``), concatenated; ``noise_embedding`` [b, Q, H]: the target's embedding of the block
(anchor token, then ``mask_token_id``); ``position_ids`` [b or 1, S + Q]: the context's positions, then the
block's. Returns the final-normed hidden states [b, Q, H] (no lm_head: the target's is used).

``attention_mask`` (optional, bool, True = may attend) [b, Q, K] or [b, 1, Q, K]; None: every key is visible
(one block whose context is everything before it, as in decoding). Layers whose ``layer_types`` entry is
``sliding_attention`` also keep only keys within ``sliding_window`` positions of the query, both ways (the
non-causal window of the z-lab model and of vLLM). ``past_key_values`` (a transformers ``Cache``): keys and values
are appended per layer, as the z-lab reference's ``spec_generate`` does; the cached keys are taken to sit at
positions 0 .. past_len - 1.

A drafter variant's counterpart (dflash_dist/model/variants/) overrides the same hooks as its training module:
``_make_layer`` (a layer with extra weights), ``_add_modules`` (weights after the layers) and ``_after_layers``
(the final hidden states); ``DominoDraftModel`` at the end of this file is the Domino variant's.
``DFlash2DraftModel`` is DFlash2's (``auto_map`` of a DFlash2 export names it): a grouped dynamic causal
convolution around attention and MLP in every layer and the candidate selector, with z-lab's API beyond the
forward::

    draft_hidden = model(...)[:, 1 - block_size:]          # the B-1 mask slots (z-lab's dflash_generate)
    logits = model.compute_logits(draft_hidden, lm_head)  # times output_multiplier, then the soft cap
    tokens, candidates, q = model.propose(draft_hidden, anchor_ids, lm_head, temperature)   # tokens [n, B-1]

``lm_head``: the target's output head as a module (``target.lm_head``, as z-lab passes it) or its weight [V, H].
``propose`` takes the hidden states of the B-1 mask slots (z-lab's convention) or of the whole block [anchor,
MASK x (B-1)] (B rows: the anchor's row is dropped); any other row count is a ValueError.
(dflash_dist/model/dflash2.py and dflash2_selector.py compute the same; tests/unit/checkpoint/
test_export_dflash2.py and tests/unit/model/test_dflash2_parity.py check both.)
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config


class DFlashRMSNorm(nn.Module):
    """Qwen3RMSNorm: variance in fp32, normalise, cast back, scale by ``weight``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def _rope_params(config) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    out = dict(scaling)
    out.update(params)
    if out.get("rope_theta") is None:
        out["rope_theta"] = getattr(config, "rope_theta", None)
    return out


class DFlashAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        h = config.hidden_size
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or h // self.num_heads
        d = self.head_dim
        self.scaling = d ** -0.5
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        types = getattr(config, "layer_types", None)
        self.sliding_window = (config.sliding_window if types and types[layer_idx] == "sliding_attention" else None)

    def forward(self, x, ctx, rope_q, rope_k, mask, past_key_values=None):
        b, q_len, _ = x.shape
        d = self.head_dim
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, d)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)                  # context first, then the block
        k = self.k_norm(self.k_proj(kv_in).view(b, -1, self.num_kv_heads, d)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, -1, self.num_kv_heads, d).transpose(1, 2)
        q = _apply_rotary(q, *rope_q)
        k = _apply_rotary(k, *rope_k)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attn_mask, row_ok = mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scaling,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        out = out * row_ok
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * d))


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, ctx, rope_q, rope_k, mask, past_key_values=None):
        h = h + self.self_attn(self.input_layernorm(h), ctx, rope_q, rope_k, mask, past_key_values)
        return h + self.mlp(self.post_attention_layernorm(h))


def _prepare(mask: torch.Tensor):
    """SDPA gives NaN on rows with no visible key (padding blocks): let them see key 0, zero their output."""
    row_ok = mask.any(-1)
    attn_mask = mask.clone()
    attn_mask[..., 0] |= ~row_ok
    return attn_mask[:, None], row_ok[:, None, :, None]


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = ""
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config):
        super().__init__(config)
        dfc = getattr(config, "dflash_config", None) or {}
        self.target_layer_ids = list(dfc["target_layer_ids"])
        self.mask_token_id = dfc.get("mask_token_id")
        self.block_size = int(dfc.get("block_size", getattr(config, "block_size", 16)))
        h = config.hidden_size
        self.layers = nn.ModuleList(self._make_layer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = DFlashRMSNorm(h, config.rms_norm_eps)
        self.norm = DFlashRMSNorm(h, config.rms_norm_eps)
        self._add_modules(config)
        rope = _rope_params(config)
        self.rope_type = rope.get("rope_type", rope.get("type", "default"))
        self.rope_theta = float(rope["rope_theta"])
        # scaled RoPE (linear, dynamic, yarn, longrope, llama3, ...): transformers' own init function for this config,
        # on the CPU in fp32 (what dflash_dist.model.rope computes); default RoPE: the formula below
        self._rope_fn, self._inv_freq, self.attention_scaling = None, None, 1.0
        if self.rope_type != "default":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            self._rope_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
            with torch.device("cpu"):
                inv, scale = self._rope_fn(config, device=torch.device("cpu"))
            self._inv_freq, self.attention_scaling = inv.float(), float(scale)
        self.post_init()

    def _make_layer(self, config, index: int) -> nn.Module:
        return DFlashDecoderLayer(config, index)

    def _add_modules(self, config) -> None:
        """A variant's weights after the layers (DFlash: none)."""

    def _after_layers(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)

    def _scaled_inv_freq(self, seq_len: int) -> torch.Tensor:
        """dynamic / longrope: transformers' forward-time choice for seq_len, without its state."""
        if "dynamic" in self.rope_type and seq_len > self.config.max_position_embeddings:
            with torch.device("cpu"):
                return self._rope_fn(self.config, device=torch.device("cpu"), seq_len=seq_len)[0].float()
        if self.rope_type == "longrope":
            omax = int(_rope_params(self.config)["original_max_position_embeddings"])
            if seq_len > omax:
                with torch.device("cpu"):
                    return self._rope_fn(self.config, device=torch.device("cpu"), seq_len=omax + 1)[0].float()
        return self._inv_freq

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, getattr(self.config, "initializer_range", 0.02))
        elif isinstance(module, DFlashRMSNorm):
            module.weight.fill_(1.0)

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype, seq_len: Optional[int] = None):
        if self._rope_fn is None:
            d = self.layers[0].self_attn.head_dim
            exponent = torch.arange(0, d, 2, dtype=torch.float32, device=positions.device) / d
            inv_freq = 1.0 / (self.rope_theta ** exponent)
        else:
            inv_freq = (self._scaled_inv_freq(seq_len) if seq_len is not None else self._inv_freq).to(positions.device)
        freqs = positions.float()[..., None] * inv_freq.float()
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def compute_logits(self, hidden_states: torch.Tensor, lm_head) -> torch.Tensor:
        """The target head's logits of any rows: ``lm_head`` a module (called) or its weight [V, H]."""
        return _apply_head(hidden_states, lm_head)

    def forward(self, position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                noise_embedding: Optional[torch.Tensor] = None, target_hidden: Optional[torch.Tensor] = None,
                past_key_values=None, use_cache: bool = False, **kwargs) -> torch.Tensor:
        ctx = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        h = noise_embedding.to(ctx.dtype)
        b, q_len, _ = h.shape
        ctx_len = ctx.shape[1]
        pos = position_ids.expand(b, -1) if position_ids.shape[0] == 1 else position_ids
        if pos.shape[1] != ctx_len + q_len:
            raise ValueError(f"position_ids cover {pos.shape[1]} positions; the context and the block are "
                             f"{ctx_len} + {q_len}")
        ctx_pos, blk_pos = pos[:, :ctx_len], pos[:, ctx_len:]
        seq_len = None
        if "dynamic" in self.rope_type or self.rope_type == "longrope":
            seq_len = int(pos.max()) + 1
        rope_q = self._rotary(blk_pos, h.dtype, seq_len)
        rope_c = self._rotary(ctx_pos, h.dtype, seq_len)
        rope_k = (torch.cat([rope_c[0], rope_q[0]], dim=1), torch.cat([rope_c[1], rope_q[1]], dim=1))
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        k_pos = pos if past == 0 else torch.cat(
            [torch.arange(past, device=pos.device).expand(b, past), pos], dim=1)
        k_len = k_pos.shape[1]
        if attention_mask is None:
            base = torch.ones(b, q_len, k_len, dtype=torch.bool, device=h.device)
        else:
            base = attention_mask
            if base.dim() == 4:
                base = base[:, 0]
            if base.dtype != torch.bool:  # an additive float mask: 0 where visible
                base = base > torch.finfo(base.dtype).min / 2
            base = base.expand(b, q_len, k_len)
        masks = {None: _prepare(base)}
        for layer in self.layers:
            w = layer.self_attn.sliding_window
            if w not in masks:
                near = (blk_pos[:, :, None] - k_pos[:, None, :]).abs() < int(w)
                masks[w] = _prepare(base & near)
        for layer in self.layers:
            h = layer(h, ctx, rope_q, rope_k, masks[layer.self_attn.sliding_window], past_key_values)
        return self._after_layers(h)
