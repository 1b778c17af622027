# DFlash2's part of the exported modeling_dflash.py (``DFlash2DraftModel``, the class ``auto_map`` of a DFlash2
# export names). Not a module of its own: dflash-export appends what follows the marker line to the base DFlash
# part (model/variants/dflash/serving.py), whose names it uses. ``_apply_head`` below is also called by the
# base part and by Domino's: it stays here so the assembled file is, byte for byte, the one exports carry.
# ruff: noqa: F821
# ---- modeling_dflash.py: exported from the next line on ----



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
