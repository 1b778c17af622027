"""Domino: the DFlash drafter plus a small GRU over the block's previous tokens that corrects the logits.

The layout SGLang (``DominoDraftModel``, projector ``domino``) and SpecForge load. For slot k of a block
(slot 0 = the anchor, slot k >= 1 predicts the token at anchor + k)::

    s_k     = GRU(embed(t_0), ..., embed(t_{k-1}))        # t_0 the anchor, t_j the token at anchor + j
    logit_k = head(h_k) + embed_proj([h_k ; s_k])         # for k >= suffix_start = 1 + pure_draft_prefix_len
    logit_k = head(h_k)                                   # for 1 <= k < suffix_start (the pure draft prefix)

``prefix_gru`` is a one-layer bias-free GRU (input H, state G_r, state 0 at every block start): it never reads
a token of another block. ``embed_proj`` = Linear(H + G_r -> E) -> SiLU -> Linear(E -> V), no biases; ``head``
and ``embed`` are the target's lm_head and embedding (frozen, not exported).

Training is teacher forced: t_j are the sequence's own tokens, whatever the loss mask. Decoding is sequential
over the block: slot k's argmax of the corrected logits becomes t_k for slot k + 1 (greedy, ``propose``).
The loss mixes the corrected and the base cross-entropy, (1 - lambda) * CE(corrected) + lambda * CE(base), with
lambda decaying linearly from ``lambda_base_start`` to 0 over the first ``lambda_base_decay_ratio`` of training
(``lambda_base``), as SpecForge trains it.

The project's slot k predicts anchor + k, which is ``shift_label: false`` in the engines' terms; SGLang serves
that alignment (with ``pure_draft_prefix_len`` 1: the first proposal is the backbone's alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dflash_dist.config import ConfigError

__all__ = ["ARCHITECTURE", "PROJECTOR_TYPE", "DominoSettings", "DominoHead", "teacher_tokens", "domino_rows",
           "DominoLossParts", "domino_loss", "propose", "lambda_base", "flops_per_block_token", "export_fields",
           "expected_shapes"]

# SGLang builds the GRU head for this class name with dflash_config.projector_type "domino"
ARCHITECTURE = "DominoDraftModel"
PROJECTOR_TYPE = "domino"


@dataclass
class DominoSettings:
    """The Domino additions to the DFlash drafter (exported under ``dflash_config``)."""

    emb_dim: int = 256
    """Width E of ``embed_proj``'s hidden layer (Linear(H + G_r -> E) -> SiLU -> Linear(E -> V)); the public
    Qwen3-8B Domino drafter uses 256."""
    gru_hidden_dim: int = 1024
    """State width G_r of ``prefix_gru``; the public Qwen3-8B Domino drafter uses 1024."""
    pure_draft_prefix_len: int = 1
    """Proposals at the block start that keep the backbone's logits (no correction). SGLang serves only 1."""
    shift_label: bool = False
    """Label alignment in the engines' terms: false = slot k predicts anchor + k (this drafter's layout)."""
    lambda_base_start: float = 1.0
    """Weight lambda of the base (uncorrected) cross-entropy at step 0; the loss is (1 - lambda) * corrected CE
    + lambda * base CE."""
    lambda_base_decay_ratio: float = 0.5
    """Fraction of the run's optimizer steps (``train.max_steps``, or what ``train.epochs`` comes to) over which
    lambda decays linearly to 0 (then stays 0)."""

    def __post_init__(self) -> None:
        for key in ("emb_dim", "gru_hidden_dim"):
            if int(getattr(self, key)) < 1:
                raise ConfigError(f"drafter.domino.{key}={getattr(self, key)}: must be >= 1")
            setattr(self, key, int(getattr(self, key)))
        if int(self.pure_draft_prefix_len) != 1:
            raise ConfigError(f"drafter.domino.pure_draft_prefix_len={self.pure_draft_prefix_len}: use 1 "
                              "(SGLang refuses anything else)")
        self.pure_draft_prefix_len = 1
        if self.shift_label is not False:
            raise ConfigError(f"drafter.domino.shift_label={self.shift_label}: use false (slot k predicts "
                              "anchor + k here; true would show the GRU the token it predicts)")
        if not 0.0 <= float(self.lambda_base_start) <= 1.0:
            raise ConfigError(f"drafter.domino.lambda_base_start={self.lambda_base_start}: must be in [0, 1]")
        if float(self.lambda_base_decay_ratio) < 0:
            raise ConfigError(f"drafter.domino.lambda_base_decay_ratio={self.lambda_base_decay_ratio}: "
                              "must be >= 0")

    @property
    def suffix_start(self) -> int:
        """The first corrected slot (slot 0 is the anchor, then the pure draft prefix)."""
        return 1 + self.pure_draft_prefix_len

    def check_model(self, block_size: int) -> None:
        """Refuse a block with no corrected slot."""
        if block_size <= self.suffix_start:
            raise ConfigError(f"drafter.block_size={block_size} leaves no slot for the Domino correction "
                              f"(needs > {self.suffix_start})")


def gru_scan(x: Tensor, weight_ih: Tensor, weight_hh: Tensor) -> Tensor:
    """nn.GRU's bias-free recurrence (gates r, z, n stacked in that order) over x [N, T, H] from state 0 -> the
    states [N, T, G], as plain ops. Training runs it instead of the module's fused kernel: cuDNN's GRU asked
    for a 2.8 GiB workspace in one piece at a Domino step on an H100, which nothing planned; these ops keep
    six [N, G] tensors per step for the backward (``GRU_SAVED_PER_STEP``), on every device alike."""
    gi = F.linear(x, weight_ih)                        # every step's input gates in one product
    h = gi.new_zeros(x.shape[0], weight_hh.shape[1])
    out = []
    for t in range(x.shape[1]):
        i_r, i_z, i_n = gi[:, t].chunk(3, dim=-1)
        h_r, h_z, h_n = F.linear(h, weight_hh).chunk(3, dim=-1)
        r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        h = n + z * (h - n)                            # (1 - z) * n + z * h
        out.append(h)
    return torch.stack(out, dim=1)


GRU_SAVED_PER_STEP = 6
"""[N, G] tensors ``gru_scan`` keeps per step for the backward: h, r, z, the hidden gate h_n, n, h - n."""


class DominoHead(nn.Module):
    """``prefix_gru`` (nn.GRU, bias-free, batch first) and ``embed_proj`` (Linear, SiLU, Linear; no biases):
    the engines' tensor names. Torch's default init; ``reset_parameters`` gives the HF init SpecForge's
    model gets (the Linear weights N(0, std), the GRU left at torch's default)."""

    def __init__(self, hidden_size: int, vocab_size: int, gru_hidden_dim: int, emb_dim: int,
                 pure_draft_prefix_len: int = 1):
        super().__init__()
        self.suffix_start = 1 + int(pure_draft_prefix_len)
        self.prefix_gru = nn.GRU(hidden_size, gru_hidden_dim, num_layers=1, bias=False, batch_first=True)
        self.embed_proj = nn.Sequential(nn.Linear(hidden_size + gru_hidden_dim, emb_dim, bias=False), nn.SiLU(),
                                        nn.Linear(emb_dim, vocab_size, bias=False))

    @torch.no_grad()
    def reset_parameters(self, initializer_range: float = 0.02) -> None:
        self.embed_proj[0].weight.normal_(0.0, initializer_range)
        self.embed_proj[2].weight.normal_(0.0, initializer_range)

    def prefix_states(self, token_embeds: Tensor, block_size: int) -> Tensor:
        """token_embeds [b, Q, H] (embeddings of the block's tokens t_0..t_{B-1}, Q = N*B) -> [b, Q, G_r]: at
        slot k the GRU state after t_0..t_{k-1} of the same block (0 at slot 0). One GRU sequence per block."""
        b, q, h = token_embeds.shape
        if q % block_size:
            raise ValueError(f"{q} query rows are not whole blocks of {block_size}")
        x = token_embeds.reshape(b * (q // block_size), block_size, h)[:, :-1]    # t_{B-1} feeds no slot
        out = gru_scan(x, self.prefix_gru.weight_ih_l0, self.prefix_gru.weight_hh_l0)
        out = torch.cat([out.new_zeros(out.shape[0], 1, out.shape[2]), out], dim=1)
        return out.reshape(b, q, -1)

    def features(self, hidden: Tensor, token_embeds: Tensor, block_size: int) -> Tensor:
        """The correction's hidden layer [b, Q, E]: SiLU(embed_proj[0]([h_k ; s_k])) at every slot."""
        states = self.prefix_states(token_embeds, block_size).to(hidden.dtype)
        return self.embed_proj[1](self.embed_proj[0](torch.cat([hidden, states], dim=-1)))

    def corrected_logits(self, base_logits: Tensor, hidden: Tensor, token_embeds: Tensor, block_size: int
                         ) -> Tensor:
        """base_logits [b, Q, V] plus the correction at slots >= suffix_start. Every row's [V] logits at
        once: for small vocabularies and checks; training goes through ``domino_loss``."""
        corr = self.embed_proj[2](self.features(hidden, token_embeds, block_size))
        slot = torch.arange(hidden.shape[1], device=hidden.device) % block_size
        return base_logits + corr * (slot >= self.suffix_start).to(corr.dtype)[:, None]


def teacher_tokens(input_ids: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """The teacher-forced GRU inputs [b, N*B]: the sequence's token at anchor + k for slot k, whatever the loss
    mask (input_ids [b, S], anchors [b, N]). Past a sample's end a slot reads the row's padding (the last
    column past the row): only slots past the end read it, and those carry no label."""
    pos = (anchors[:, :, None] + torch.arange(block_size, device=anchors.device)).clamp(max=input_ids.shape[1] - 1)
    return input_ids.gather(1, pos.reshape(anchors.shape[0], -1))


def domino_rows(hidden: Tensor, features: Tensor, labels: Tensor, weights: Tensor, block_size: int,
                suffix_start: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The training layout [b, N*B, ...] to the rows that can carry a loss (slots 1..B-1, block order): (hidden
    [R, H], correction features [R, E], corrected [R] bool, labels [R], weights [R]). Static slicing."""
    def rows(t: Tensor) -> Tensor:
        t = t.unflatten(1, (-1, block_size))[:, :, 1:]
        return t.reshape(-1, *t.shape[3:])

    slot = torch.arange(hidden.shape[1], device=hidden.device).expand(hidden.shape[0], -1) % block_size
    return rows(hidden), rows(features), rows(slot >= suffix_start), rows(labels), rows(weights)


@dataclass
class DominoLossParts:
    """The mixed loss sum (carries grad), the weight sum, the two CE sums (detached) and per-row argmax hits."""

    loss_sum: Tensor        # sum w * ((1 - lambda) * CE(corrected) + lambda * CE(base))
    weight_sum: Tensor
    final_ce_sum: Tensor
    base_ce_sum: Tensor
    final_correct: Tensor   # [R] bool: the row has a label, the corrected argmax is it
    base_correct: Tensor    # [R] bool: the row has a label, the base argmax is it


def _chunk(h: Tensor, e: Tensor, corrected: Tensor, head_weight: Tensor, proj_weight: Tensor, y: Tensor,
           w: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Weighted CE sums (corrected, base) and argmaxes of one row chunk; fp32 logits."""
    base = (h @ head_weight.t()).float()
    final = base + (e @ proj_weight.t()).float() * corrected.to(torch.float32)[:, None]
    y_safe = y.clamp_min(0)
    ce_f = F.cross_entropy(final, y_safe, reduction="none")
    ce_b = F.cross_entropy(base, y_safe, reduction="none")
    with torch.no_grad():
        pred_f, pred_b = final.argmax(-1), base.argmax(-1)
    return (ce_f * w).sum(), (ce_b * w).sum(), pred_f, pred_b


def domino_loss(rows_h: Tensor, rows_e: Tensor, corrected: Tensor, head_weight: Tensor, proj_weight: Tensor,
                labels: Tensor, weights: Tensor, lam: float, chunk_rows: int) -> DominoLossParts:
    """The mixed cross-entropy over loss rows (``domino_rows``), the vocab projections chunk by chunk: at most
    one chunk's [rows, V] logits alive, recomputed in backward (the correction's last Linear, ``proj_weight``
    = embed_proj[2].weight, trains). ``weights``: the base objective's row weights (0 where no label). Returns
    sums: the caller normalises over the whole step."""
    w = weights.float() * (labels >= 0)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (rows_h, rows_e, proj_weight))
    sums_f, sums_b, preds_f, preds_b = [], [], [], []
    for lo in range(0, labels.numel(), max(1, int(chunk_rows))):
        sl = slice(lo, lo + max(1, int(chunk_rows)))
        args = (rows_h[sl], rows_e[sl], corrected[sl], head_weight, proj_weight, labels[sl], w[sl])
        f, b, pf, pb = checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args)
        sums_f.append(f)
        sums_b.append(b)
        preds_f.append(pf)
        preds_b.append(pb)
    if sums_f:
        final, base = torch.stack(sums_f).sum(), torch.stack(sums_b).sum()
    else:                                                      # no rows: keep the graph connected
        final = base = (rows_h.sum() + rows_e.sum()).float() * 0.0
    has = labels >= 0
    pred_f = torch.cat(preds_f) if preds_f else labels
    pred_b = torch.cat(preds_b) if preds_b else labels
    return DominoLossParts(loss_sum=(1.0 - lam) * final + lam * base, weight_sum=w.sum(),
                           final_ce_sum=final.detach(), base_ce_sum=base.detach(),
                           final_correct=(pred_f == labels) & has, base_correct=(pred_b == labels) & has)


@torch.no_grad()
def propose(head: DominoHead, hidden: Tensor, anchor_ids: Tensor, head_weight: Tensor, embed_weight: Tensor
            ) -> tuple[Tensor, Tensor]:
    """Greedy proposals of one block as the engines decode it. hidden [n, B, H] (the drafter's final hidden
    states, slot 0 = the anchor), anchor_ids [n], head_weight [V, H] and embed_weight [V, H] the target's.
    Sequential over the slots: the GRU reads the anchor, then each proposal as it is made. Returns (tokens
    [n, B-1], the logits each was the argmax of [n, B-1, V] fp32). SGLang by default takes the argmax among
    the 2048 tokens with the highest base logits over the block (``--speculative-domino-candidate-pool-size``;
    0 scores the full vocabulary, as here): the same token whenever the winner is among them."""
    n, block_size, _ = hidden.shape
    base = hidden[:, 1:] @ head_weight.t()
    _, state = head.prefix_gru(F.embedding(anchor_ids, embed_weight)[:, None].to(hidden.dtype))   # h0 = 0
    tokens, logits = [], []
    for k in range(1, block_size):
        row = base[:, k - 1]
        if k >= head.suffix_start:
            feats = head.embed_proj[1](head.embed_proj[0](torch.cat([hidden[:, k], state[0]], dim=-1)))
            row = row + head.embed_proj[2](feats)
        tok = row.argmax(-1)
        tokens.append(tok)
        logits.append(row.float())
        if k < block_size - 1:
            _, state = head.prefix_gru(F.embedding(tok, embed_weight)[:, None].to(hidden.dtype), state)
    return torch.stack(tokens, 1), torch.stack(logits, 1)


def lambda_base(step: int, total_steps: int, settings: DominoSettings) -> float:
    """The base CE's weight for the step after ``step`` optimizer steps (0 for the first) of ``total_steps``
    (the run's optimizer steps in all; a resumed run goes on from its step): lambda_base_start * (1 - progress),
    progress = step / max(1, int(total_steps * decay_ratio)) capped at 1, clamped to [0, 1] (SpecForge's
    ``linear_lambda_base``)."""
    if int(total_steps) <= 0:
        raise ConfigError(f"total_steps={total_steps}: the Domino curriculum needs the run's step count (> 0)")
    decay_steps = max(1, int(total_steps * float(settings.lambda_base_decay_ratio)))
    progress = min(step / decay_steps, 1.0)
    return max(0.0, min(1.0, float(settings.lambda_base_start) * (1.0 - progress)))


def flops_per_block_token(hidden_size: int, vocab_size: int, block_size: int, settings: DominoSettings) -> dict:
    """Forward FLOPs of the head in the training layout per block slot (2 per multiply-add), averaged over the
    B slots of a block: the GRU's input and state matmuls (6 G_r (H + G_r) per step, B-1 steps per block: the
    same in decoding), ``embed_proj[0]`` (2 (H + G_r) E) on every slot and ``embed_proj[2]`` (2 E V) on the
    B-1 loss rows (``domino_loss``; decoding needs only the corrected slots). All are trainable matmuls (x3
    with backward, as telemetry/flops.py counts them); the base logits are the lm_head's, counted there."""
    g, e, h, b = settings.gru_hidden_dim, settings.emb_dim, hidden_size, block_size
    return {"gru": (b - 1) / b * 6.0 * g * (h + g), "projection": 2.0 * (h + g) * e,
            "vocab": (b - 1) / b * 2.0 * e * vocab_size}


def export_fields(settings: DominoSettings) -> dict:
    """The Domino part of ``config.json``: the architecture, ``emb_dim`` at the top level too (as the public
    checkpoints write it; SGLang refuses two different values) and the ``dflash_config`` fields SGLang parses."""
    return {"architectures": [ARCHITECTURE], "emb_dim": settings.emb_dim,
            "dflash_config": {"projector_type": PROJECTOR_TYPE, "emb_dim": settings.emb_dim,
                              "gru_hidden_dim": settings.gru_hidden_dim,
                              "pure_draft_prefix_len": settings.pure_draft_prefix_len,
                              "shift_label": bool(settings.shift_label)}}


def expected_shapes(hidden_size: int, vocab_size: int, settings: DominoSettings) -> dict[str, tuple[int, ...]]:
    """Every tensor Domino adds to a DFlash ``model.safetensors`` (no ``model.`` prefix), with its shape."""
    g, e = settings.gru_hidden_dim, settings.emb_dim
    return {"prefix_gru.weight_ih_l0": (3 * g, hidden_size), "prefix_gru.weight_hh_l0": (3 * g, g),
            "embed_proj.0.weight": (e, hidden_size + g), "embed_proj.2.weight": (vocab_size, e)}
