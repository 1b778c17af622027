"""The DFlash2 candidate selector: re-ranks the target head's top-K per position by the previous token.

For block position j, predecessor p and candidate c (K candidates: the top-K of the unary logits, i.e. the
target head's logits times ``output_multiplier``, then soft-capped)::

    S[j, p, c] = unary[j, c] + < A[p] * (W_h h_j), B[c] >

A = ``predecessor_codebook`` [V, r], B = ``successor_codebook`` [V, r] (bare parameters: the engines load them
without a ``.weight`` suffix), W_h = ``hidden_projection`` [r, H], h_j the drafter's final hidden state.

Decoding walks the lattice: idx_0 = argmax of row 0 (the anchor's row), idx_j = argmax S[j, idx_{j-1}, :].
Training scores each position with its teacher-forced predecessor (the gold previous token; the anchor for
slot 1) in a K-way cross-entropy; up to a block's first miss those predecessors are the walk's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_dist.model.loss import grouped_topk

__all__ = ["CandidateSelector", "transform_logits", "unary_topk", "grouped_topk", "topk_candidates", "candidate_logits",
           "lattice", "walk", "greedy_walk", "propose", "block_gold", "teacher_forced_predecessors", "selector_rows",
           "SelectorLossParts", "selector_loss", "accepted_lengths"]

GOLD_MODES = ("exclude", "replace_last")


class CandidateSelector(nn.Module):
    """``hidden_projection`` Linear(H -> r, no bias), ``predecessor_codebook`` and ``successor_codebook`` [V, r].
    Init as SpecForge and Automodel: the successor codebook at zero (the selector starts as unary-only)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, initializer_range: float = 0.02):
        super().__init__()
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.reset_parameters(initializer_range)

    @torch.no_grad()
    def reset_parameters(self, initializer_range: float = 0.02) -> None:
        self.hidden_projection.weight.normal_(0.0, initializer_range)
        self.predecessor_codebook.normal_(0.0, initializer_range)
        self.successor_codebook.zero_()

    def scores(self, h: Tensor, pred_ids: Tensor, cand_ids: Tensor, unary: Tensor) -> Tensor:
        """S = unary + <A[pred] * W_h h, B[cand]>, fp32. h [..., H], cand_ids and unary [..., K]; pred_ids [...]
        (one predecessor per row: returns [..., K]) or [..., P] (P predecessors per row: returns [..., P, K])."""
        single = pred_ids.dim() == h.dim() - 1
        preds = pred_ids[..., None] if single else pred_ids
        pred = self.predecessor_codebook[preds]                                        # [..., P, r]
        context = pred * self.hidden_projection(h).to(pred.dtype)[..., None, :]
        succ = self.successor_codebook[cand_ids]                                       # [..., K, r]
        s = unary.float()[..., None, :] + torch.matmul(context, succ.transpose(-1, -2)).float()
        return s[..., 0, :] if single else s


def transform_logits(x: Tensor, output_multiplier: float, softcap: Optional[float]) -> Tensor:
    """The engines' unary transform, in this order: times ``output_multiplier``, then c * tanh(x / c) if c."""
    x = x * output_multiplier if output_multiplier != 1.0 else x
    return softcap * torch.tanh(x / softcap) if softcap else x


def unary_topk(logits: Tensor, k: int, output_multiplier: float = 1.0, softcap: Optional[float] = None
               ) -> tuple[Tensor, Tensor]:
    """Top-K of the full-vocabulary logits [..., V], then the transform: (unary fp32 [..., K], ids [..., K]),
    best first. Both transforms are monotone, so the K ids are those of the transformed logits."""
    top = logits.topk(k, dim=-1)
    return transform_logits(top.values.float(), output_multiplier, softcap), top.indices


@torch.no_grad()
def topk_candidates(h: Tensor, head_weight: Tensor, k: int, chunk_rows: int = 1024) -> Tensor:
    """Top-K ids [R, K] of rows h [R, H] through the head [V, H], a chunk of rows at a time (at most one chunk of
    [rows, V] logits alive; ``grouped_topk``). No gradient: the candidate set is a selection."""
    hc = h.to(head_weight.dtype)
    ids = [grouped_topk(hc[lo:lo + chunk_rows] @ head_weight.t(), k)
           for lo in range(0, hc.shape[0], max(1, int(chunk_rows)))]
    return torch.cat(ids) if ids else h.new_zeros(0, k, dtype=torch.long)


class _GatheredHeadDots(torch.autograd.Function):
    """raw[r, c] = <W[ids[r, c]], h[r]> for rows h [R, H], ids [R, K], a frozen head W [V, H]: the gathered head rows
    [rows, K, H] exist one chunk of rows at a time in forward and not at all in backward (d h[r] = sum_c g[r, c]
    W[ids[r, c]], an ``embedding_bag``), instead of [R, K, H] kept for backward (1 GB at 8B shapes)."""

    CHUNK_ROWS = 2048

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, ids: Tensor) -> Tensor:
        hw = h.to(weight.dtype)
        raw = [torch.matmul(weight[ids[lo:lo + _GatheredHeadDots.CHUNK_ROWS]],
                            hw[lo:lo + _GatheredHeadDots.CHUNK_ROWS, :, None]).squeeze(-1)
               for lo in range(0, h.shape[0], _GatheredHeadDots.CHUNK_ROWS)]
        ctx.save_for_backward(weight, ids)
        ctx.h_dtype = h.dtype
        return torch.cat(raw) if raw else ids.new_zeros(ids.shape, dtype=weight.dtype)

    @staticmethod
    def backward(ctx, grad_raw: Tensor):
        weight, ids = ctx.saved_tensors
        grad_h = F.embedding_bag(ids, weight, per_sample_weights=grad_raw.to(weight.dtype), mode="sum")
        return grad_h.to(ctx.h_dtype), None, None


def candidate_logits(h: Tensor, head_weight: Tensor, ids: Tensor, output_multiplier: float = 1.0,
                     softcap: Optional[float] = None) -> Tensor:
    """Transformed unary logits fp32 [..., K] of the candidate ids [..., K] for rows h [..., H], from the gathered
    head rows (differentiable in h, not in the frozen head; the same values as ``unary_topk`` at those ids)."""
    if head_weight.requires_grad:
        raise ValueError("candidate_logits takes the frozen target head (head_weight.requires_grad is True)")
    lead = ids.shape[:-1]
    raw = _GatheredHeadDots.apply(h.reshape(-1, h.shape[-1]), head_weight, ids.reshape(-1, ids.shape[-1]))
    return transform_logits(raw.reshape(*lead, ids.shape[-1]).float(), output_multiplier, softcap)


def lattice(selector: CandidateSelector, hidden: Tensor, anchor_ids: Tensor, cand_ids: Tensor, unary: Tensor
            ) -> Tensor:
    """The decoding lattice S [n, L, K, K] of one block's L = B-1 mask slots: hidden [n, L, H], anchor_ids [n],
    cand_ids and unary [n, L, K]. Row j's predecessors are slot j-1's candidates; row 0's are the anchor for
    every p (the anchor's row repeated), so a walk reads every row the same way."""
    n, _, k = cand_ids.shape
    preds = torch.cat([anchor_ids.reshape(n, 1, 1).expand(n, 1, k), cand_ids[:, :-1]], dim=1)
    return selector.scores(hidden, preds, cand_ids, unary)


def walk(s: Tensor, temperature: float = 0.0, generator: Optional[torch.Generator] = None
         ) -> tuple[Tensor, Tensor]:
    """Walk the lattice s [n, L, K, K]: (candidate indices [n, L], the realised rows S[j, idx_{j-1}, :] [n, L, K]).
    Greedy (temperature 0): argmax, ties to the lowest index (as vLLM). Otherwise Gumbel-max on rows / T."""
    n, length, k, _ = s.shape
    idx = torch.zeros(n, dtype=torch.long, device=s.device)           # row 0 is the same for every p
    picks, rows = [], []
    for j in range(length):                                            # sequential: row j depends on idx_{j-1}
        row = s[:, j].gather(1, idx.view(n, 1, 1).expand(n, 1, k)).squeeze(1)
        if temperature > 0:
            u = torch.rand(row.shape, generator=generator,
                           device=row.device if generator is None else generator.device).to(row.device)
            gumbel = -torch.log((-torch.log(u.clamp_min(1e-20))).clamp_min(1e-20))
            idx = (row / temperature + gumbel).argmax(-1)
        else:
            idx = row.argmax(-1)
        picks.append(idx)
        rows.append(row)
    return torch.stack(picks, 1), torch.stack(rows, 1)


def greedy_walk(s: Tensor) -> Tensor:
    """Greedy candidate indices [n, L] of the lattice s [n, L, K, K]."""
    return walk(s)[0]


@torch.no_grad()
def propose(selector: CandidateSelector, hidden: Tensor, anchor_ids: Tensor, head_weight: Tensor, top_k: int,
            output_multiplier: float = 1.0, softcap: Optional[float] = None, temperature: float = 0.0,
            generator: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor, Tensor]:
    """One block's proposal. hidden [n, B, H]: the drafter's final hidden states of [anchor, MASK x (B-1)];
    anchor_ids [n]; head_weight [V, H] (the target's lm_head). Returns (tokens [n, B-1], candidates [n, B-1, K],
    q [n, B-1, K]): q is the proposal distribution over the candidates, softmax(S[j, idx_{j-1}, :] / T), one-hot
    when greedy."""
    logits = hidden[:, 1:].to(head_weight.dtype) @ head_weight.t()
    unary, cand = unary_topk(logits, top_k, output_multiplier, softcap)
    idx, rows = walk(lattice(selector, hidden[:, 1:], anchor_ids, cand, unary), temperature, generator)
    tokens = cand.gather(-1, idx[..., None]).squeeze(-1)
    q = torch.softmax(rows / temperature, -1) if temperature > 0 else F.one_hot(idx, top_k).to(rows.dtype)
    return tokens, cand, q


def block_gold(block_ids: Tensor, labels: Tensor, block_size: int) -> Tensor:
    """Each block's gold tokens [b, Q]: the anchor at slot 0, the label at slots >= 1 (negative where none)."""
    slot = torch.arange(block_ids.shape[-1], device=block_ids.device) % block_size
    return torch.where(slot == 0, block_ids, labels)


def teacher_forced_predecessors(gold: Tensor, block_size: int) -> Tensor:
    """The predecessor of every slot [..., Q] from the blocks' gold tokens [..., Q]: the anchor for slots 0 and
    1, slot k-1's gold token for k >= 2 (blocks [2..5], [8..11] -> [2, 2, 3, 4], [8, 8, 9, 10])."""
    blocks = gold.unflatten(-1, (-1, block_size))
    return torch.cat([blocks[..., :1], blocks[..., :-1]], dim=-1).flatten(-2)


def selector_rows(hidden: Tensor, block_ids: Tensor, labels: Tensor, weights: Tensor, block_size: int
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The training layout [b, N*B, ...] to the rows that can carry a selector loss (slots 1..B-1): (hidden
    [R, H], predecessors [R], gold [R], weights [R]). A slot whose predecessor has no label (a hole in the loss
    mask) gets a negative predecessor: no selector loss there. Static slicing: no host sync."""
    gold = block_gold(block_ids, labels, block_size)
    pred = teacher_forced_predecessors(gold, block_size)

    def rows(t: Tensor) -> Tensor:
        t = t.unflatten(1, (-1, block_size))[:, :, 1:]
        return t.reshape(-1, *t.shape[3:])

    return rows(hidden), rows(pred), rows(gold), rows(weights)


@dataclass
class SelectorLossParts:
    """Weighted K-way CE sum (carries grad) and weight sum, plus per-row statistics (bool, no grad)."""

    loss_sum: Tensor
    weight_sum: Tensor
    supervised: Tensor        # the row has a label and a known predecessor
    gold_in_topk: Tensor      # the row has a label, among the unary top-K
    unary_correct: Tensor     # the row has a label, the unary argmax (top-1)
    selector_correct: Tensor  # the selector's choice with the gold predecessor (the walk's, up to a miss) is gold


def selector_loss(selector: CandidateSelector, hidden: Tensor, head_weight: Tensor, pred_ids: Tensor,
                  cand_ids: Tensor, gold: Tensor, weights: Tensor, gold_mode: str = "exclude",
                  output_multiplier: float = 1.0, softcap: Optional[float] = None) -> SelectorLossParts:
    """The selector's K-way cross-entropy over rows: hidden [R, H], pred_ids [R] (teacher forced, negative =
    unknown), cand_ids [R, K] (the unary top-K, best first: ``topk_candidates``), gold [R] (negative = no label),
    weights [R] (the base objective's weights). A gold token outside the top-K: ``exclude`` drops the row,
    ``replace_last`` puts it in the last candidate's place with its own unary logit. Returns the weighted sum
    and the weight sum apart: the caller normalises over the whole step. The unary logits are recomputed from
    the gathered head rows (``candidate_logits``: a chunk of rows at a time, none kept for backward)."""
    if gold_mode not in GOLD_MODES:
        raise ValueError(f"gold_mode={gold_mode!r}: use one of {GOLD_MODES}")
    k = cand_ids.shape[-1]
    hit = cand_ids == gold[..., None]
    in_topk = hit.any(-1)
    has_label = gold >= 0
    known = has_label & (pred_ids >= 0)
    target = hit.int().argmax(-1)
    ids = cand_ids
    if gold_mode == "replace_last":
        last = torch.where(in_topk, cand_ids[..., -1], gold.clamp_min(0))
        ids = torch.cat([cand_ids[..., :-1], last[..., None]], dim=-1)
        target = torch.where(in_topk, target, torch.full_like(target, k - 1))
        supervised = known
    else:
        supervised = known & in_topk
    unary = candidate_logits(hidden, head_weight, ids, output_multiplier, softcap)
    s = selector.scores(hidden, pred_ids.clamp_min(0), ids, unary)
    ce = F.cross_entropy(s.reshape(-1, k), target.reshape(-1), reduction="none").view_as(target)
    w = weights.float() * supervised
    with torch.no_grad():
        chosen = ids.gather(-1, s.argmax(-1, keepdim=True)).squeeze(-1)
        selector_correct = (chosen == gold) & in_topk & known
        unary_correct = (cand_ids[..., 0] == gold) & has_label
    return SelectorLossParts(loss_sum=(ce * w).sum(), weight_sum=w.sum(), supervised=supervised,
                             gold_in_topk=in_topk & has_label, unary_correct=unary_correct,
                             selector_correct=selector_correct)


def accepted_lengths(correct: Tensor, supervised: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Greedy accepted length of every block from per-row results over slots 1..B-1 (``selector_rows`` order,
    [b*N*(B-1)]): 1 (the bonus token) + the matched prefix, a row without supervision ending the prefix.
    Returns (lengths [blocks] fp32, block has a supervised row [blocks] bool). Under teacher forcing this is
    the walk's accepted length: up to the first miss the gold predecessors are the walk's."""
    ok = (correct & supervised).reshape(-1, block_size - 1)
    return 1.0 + ok.int().cumprod(-1).sum(-1).float(), supervised.reshape(-1, block_size - 1).any(-1)
