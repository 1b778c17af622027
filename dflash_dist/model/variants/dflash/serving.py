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



class DFlash2Conv(nn.Module):
    """Input-side and output-side grouped dynamic causal convolutions of one sublayer (``base_kernel`` [2, k, H],
    ``kernel_projection`` H -> 2*k*G): coef[t, tap, c] = base_kernel[side, tap, c] + delta[t, side, tap, c // g],
    out[t] = sum_tap coef[t, tap] * x[t - tap], a tap zeroed where the position in block (row index mod B) < tap."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)

    def prepare(self, x):
        delta = self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, self.num_groups))
        return self._conv(x, delta[..., 0, :, :], 0), delta[..., 1, :, :]

    def finish(self, y, delta_out):
        return self._conv(y, delta_out, 1)

    def _conv(self, x, delta, side: int):
        q_len, hidden = x.shape[-2], x.shape[-1]
        if q_len % self.block_size:
            raise ValueError(f"{q_len} query rows are not whole blocks of {self.block_size}")
        pos = torch.arange(q_len, device=x.device) % self.block_size
        xg = x.unflatten(-1, (self.num_groups, self.group_size))
        base = self.base_kernel[side].to(x.dtype).view(self.kernel_size, self.num_groups, self.group_size)
        delta = delta.to(x.dtype)
        out = xg * (base[0] + delta[..., 0, :, None])
        for tap in range(1, self.kernel_size):
            shifted = torch.cat([xg.new_zeros(*xg.shape[:-3], tap, *xg.shape[-2:]), xg[..., :-tap, :, :]], dim=-3)
            keep = (pos >= tap).to(x.dtype)[:, None, None]
            out = out + shifted * (base[tap] + delta[..., tap, :, None]) * keep
        return out.reshape(*x.shape[:-1], hidden)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        dfc = config.dflash_config
        args = (config.hidden_size, int(dfc["conv_kernel_size"]), int(dfc["conv_group_size"]),
                int(dfc.get("block_size", getattr(config, "block_size", 16))))
        self.attention_conv = DFlash2Conv(*args)
        self.mlp_conv = DFlash2Conv(*args)

    def forward(self, h, ctx, rope_q, rope_k, mask, past_key_values=None):
        x, d = self.attention_conv.prepare(self.input_layernorm(h))
        a = self.self_attn(x, ctx, rope_q, rope_k, mask, past_key_values)   # the context's keys: no conv
        h = h + self.attention_conv.finish(a, d)
        x, d = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), d)


class DFlash2CandidateSelector(nn.Module):
    """S[p, c] = unary[c] + <A[p] * (W_h h), B[c]>: A = predecessor_codebook, B = successor_codebook [V, r]
    (bare parameters, no ``.weight``), W_h = hidden_projection [r, H]."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int):
        super().__init__()
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))

    def scores(self, h, pred_ids, cand_ids, unary):
        """h [..., H], pred_ids [..., P], cand_ids and unary [..., K] -> fp32 [..., P, K]."""
        context = self.predecessor_codebook[pred_ids] * self.hidden_projection(h)[..., None, :].to(
            self.predecessor_codebook.dtype)
        succ = self.successor_codebook[cand_ids]
        return unary.float()[..., None, :] + torch.matmul(context, succ.transpose(-1, -2)).float()


def _apply_head(hidden_states: torch.Tensor, lm_head) -> torch.Tensor:
    """The target's head on ``hidden_states``: a module called (``target.lm_head``), a weight [V, H] multiplied."""
    if isinstance(lm_head, torch.Tensor):
        return hidden_states.to(lm_head.dtype) @ lm_head.t()
    if not callable(lm_head):
        raise TypeError(f"lm_head: the target's output head as a module or its weight tensor [V, H], got "
                        f"{type(lm_head).__name__}")
    return lm_head(hidden_states)


def _head_weight(lm_head) -> Optional[torch.Tensor]:
    """The [V, H] weight that is the whole head: a tensor itself, or a bias-free module's 2-D ``weight``
    (nn.Linear, a tied embedding); None for any other callable (called instead)."""
    if isinstance(lm_head, torch.Tensor):
        return lm_head
    w = getattr(lm_head, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2 and getattr(lm_head, "bias", None) is None:
        return w
    if callable(lm_head):
        return None
    raise TypeError(f"lm_head: the target's output head as a module or its weight tensor [V, H], got "
                    f"{type(lm_head).__name__}")


def _head_logits(hidden_states: torch.Tensor, lm_head) -> torch.Tensor:
    """``hidden_states`` times the head: the weight's matmul in its dtype, or the module's own call."""
    w = _head_weight(lm_head)
    if w is None:
        return lm_head(hidden_states)
    return hidden_states.to(w.dtype) @ w.t()


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2: DFlash layers with ``attention_conv`` / ``mlp_conv`` and a ``candidate_selector`` over the target
    head's top-K (``dflash_config``: conv_kernel_size, conv_group_size, selector_rank, selector_top_k,
    output_multiplier, final_logit_softcapping)."""

    _no_split_modules = ["DFlash2DecoderLayer"]

    def _make_layer(self, config, index: int) -> nn.Module:
        return DFlash2DecoderLayer(config, index)

    def _add_modules(self, config) -> None:
        dfc = config.dflash_config
        self.selector_top_k = int(dfc["selector_top_k"])
        self.output_multiplier = float(dfc.get("output_multiplier") or 1.0)
        self.final_logit_softcapping = float(dfc.get("final_logit_softcapping") or 0.0)
        self.candidate_selector = DFlash2CandidateSelector(config.hidden_size, config.vocab_size,
                                                           int(dfc["selector_rank"]))

    @torch.no_grad()
    def _init_weights(self, module):
        # identity convolutions and a zero successor codebook (the trainers' init); the rest as DFlash
        super()._init_weights(module)
        if isinstance(module, DFlash2Conv):
            module.base_kernel.zero_()
            module.base_kernel[:, 0] = 1.0
            module.kernel_projection.weight.zero_()
        elif isinstance(module, DFlash2CandidateSelector):
            module.predecessor_codebook.normal_(0.0, getattr(self.config, "initializer_range", 0.02))
            module.successor_codebook.zero_()

    def _transform(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.output_multiplier if self.output_multiplier != 1.0 else x
        cap = self.final_logit_softcapping
        return cap * torch.tanh(x / cap) if cap else x

    def compute_logits(self, hidden_states: torch.Tensor, lm_head) -> torch.Tensor:
        """The unary logits: the target head's, times ``output_multiplier``, then soft-capped (fp32)."""
        return self._transform(_head_logits(hidden_states, lm_head).float())

    def _mask_rows(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The B-1 mask slots' rows of one block per row of ``hidden_states``: given as they are (z-lab's
        ``model(...)[:, 1 - block_size:]``), or the whole block's B rows with the anchor's row dropped."""
        rows, bsz = hidden_states.shape[-2], self.block_size
        if hidden_states.dim() != 3 or rows not in (bsz - 1, bsz):
            raise ValueError(f"propose takes the final hidden states [n, {bsz - 1}, H] of a block's {bsz - 1} mask "
                             f"slots (or [n, {bsz}, H] with the anchor's row first), got "
                             f"{tuple(hidden_states.shape)}")
        return hidden_states[:, 1:] if rows == bsz else hidden_states

    @torch.no_grad()
    def propose(self, hidden_states: torch.Tensor, anchor_ids: torch.Tensor, lm_head, temperature: float = 0.0,
                generator: Optional[torch.Generator] = None):
        """One block's proposal from the final hidden states of its B-1 mask slots [n, B-1, H] (z-lab's
        ``dflash_generate`` passes ``model(...)[:, 1 - block_size:]``; [n, B, H] of [anchor, MASK x (B-1)] is
        taken too, its first row dropped), the anchors [n] and the target's head (module or weight [V, H]):
        (tokens [n, B-1], candidates [n, B-1, K], q [n, B-1, K]). Candidates: the unary top-K per mask slot;
        the walk: idx_0 from the anchor's row, idx_j = choice over S[j, idx_{j-1}, :] (greedy: argmax, ties to
        the lowest index; T > 0: Gumbel-max on S / T); q = softmax(row / T), one-hot when greedy."""
        hidden = self._mask_rows(hidden_states)
        top = _head_logits(hidden, lm_head).topk(self.selector_top_k, dim=-1)
        cand, unary = top.indices, self._transform(top.values.float())
        n, length, k = cand.shape
        if anchor_ids.numel() != n:
            raise ValueError(f"{anchor_ids.numel()} anchor ids for {n} blocks")
        preds = torch.cat([anchor_ids.reshape(n, 1, 1).to(cand.device).expand(n, 1, k), cand[:, :-1]], dim=1)
        lattice = self.candidate_selector.scores(hidden, preds, cand, unary)   # [n, L, K, K]
        idx = torch.zeros(n, dtype=torch.long, device=cand.device)
        picks, rows = [], []
        for j in range(length):
            row = lattice[:, j].gather(1, idx.view(n, 1, 1).expand(n, 1, k)).squeeze(1)
            if temperature > 0:
                u = torch.rand(row.shape, generator=generator,
                               device=row.device if generator is None else generator.device).to(row.device)
                gumbel = -torch.log((-torch.log(u.clamp_min(1e-20))).clamp_min(1e-20))
                idx = (row / temperature + gumbel).argmax(-1)
            else:
                idx = row.argmax(-1)
            picks.append(idx)
            rows.append(row)
        idx, rows = torch.stack(picks, 1), torch.stack(rows, 1)
        tokens = cand.gather(-1, idx[..., None]).squeeze(-1)
        q = torch.softmax(rows / temperature, -1) if temperature > 0 else F.one_hot(idx, k).to(rows.dtype)
        return tokens, cand, q


class DominoDraftModel(DFlashDraftModel):
    """Domino (``architectures: ["DominoDraftModel"]``, ``dflash_config.projector_type: "domino"``): DFlash plus a
    bias-free GRU (``prefix_gru``) over the embeddings of the block's previous tokens, whose projection
    (``embed_proj``: Linear(H + G_r -> E), SiLU, Linear(E -> V)) is added to the base logits of the slots from
    ``1 + pure_draft_prefix_len`` on. The hidden states are DFlash's; the logits need the block's tokens::

        logits = model.compute_logits(hidden, target.lm_head, target.embed_tokens(block_tokens))

    ``block_tokens`` [b, N*B]: t_0 (the anchor) .. t_{B-1} of each block; slot k's GRU state reads t_0..t_{k-1}
    of its own block only (teacher forcing; in decoding, t_k is slot k's proposal)."""

    def _add_modules(self, config) -> None:
        dfc = config.dflash_config
        h, g, e = config.hidden_size, int(dfc["gru_hidden_dim"]), int(dfc["emb_dim"])
        self.suffix_start = 1 + int(dfc["pure_draft_prefix_len"])
        self.prefix_gru = nn.GRU(h, g, num_layers=1, bias=False, batch_first=True)
        self.embed_proj = nn.Sequential(nn.Linear(h + g, e, bias=False), nn.SiLU(),
                                        nn.Linear(e, config.vocab_size, bias=False))

    def compute_logits(self, hidden_states: torch.Tensor, lm_head: nn.Module,
                       token_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        if token_embeds is None:
            raise ValueError("DominoDraftModel.compute_logits needs token_embeds: the target's embeddings of the "
                             "block's tokens (anchor, then each slot's token)")
        b, q, h = hidden_states.shape
        bsz = self.block_size
        if q % bsz:
            raise ValueError(f"DominoDraftModel.compute_logits takes whole blocks of {bsz} rows (the anchor's row "
                             f"first: slot k's correction reads the block's tokens before it), got {q} rows")
        x = token_embeds.to(hidden_states.dtype).reshape(b * (q // bsz), bsz, h)[:, :-1]
        out, _ = self.prefix_gru(x)
        states = torch.cat([out.new_zeros(out.shape[0], 1, out.shape[2]), out], dim=1).reshape(b, q, -1)
        corr = self.embed_proj(torch.cat([hidden_states, states.to(hidden_states.dtype)], dim=-1))
        slot = torch.arange(q, device=hidden_states.device) % bsz
        return _apply_head(hidden_states, lm_head) + corr * (slot >= self.suffix_start).to(corr.dtype)[:, None]
