# Domino's part of the exported modeling_dflash.py (``DominoDraftModel``, the class ``auto_map`` of a Domino
# export names). Not a module of its own: dflash-export appends what follows the marker line after the base
# DFlash part (model/variants/dflash/serving.py) and the parts before it, whose names it uses.
# ruff: noqa: F821
# ---- modeling_dflash.py: exported from the next line on ----


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
