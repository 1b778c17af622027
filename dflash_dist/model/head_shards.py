"""The frozen head's cross-entropy over a vocabulary split in slices (``drafter.tuning.loss_on_target`` on a target
replica: every rank of it serves its slice of the lm_head rows, the drafter combines).

A slice [lo, hi) of the vocabulary sees only its own logits z_s, so each rank returns, per loss row, what no other
slice changes: its max logit m_s, its sum of exp(z_s - m_s), the logits of the ids the loss needs where they are
in the slice (the label; KL: the target's top-k; 0 elsewhere), the global id of its max, and
G_s = exp(z_s - m_s) @ W_s [R, H]. The drafter then has, exactly as one rank over the whole head would:

    lse = log sum_s exp(m_s) sum_s'     CE = lse - z_label     argmax: the best logit, the lowest id among equal
    d CE / d h = sum_s exp(m_s - lse) G_s - W[label]      (W[label]: a row of the drafter's own frozen head)

and for KL to p over the ids i: KL = sum_i p_i (log p_i - z_i + lse), d KL / d h = sum(p) sum_s exp(m_s - lse)
G_s - sum_i p_i W[i].

Each slice's reply is independent of the others (no collective between the replica's ranks), so every rank serves
its requests at its own boundaries. The weights of the rows multiply CE and its gradient, so the objective applies
them after ``combine`` (decay's slot weights or D-PACE's, which depend on the combined CE). One rank's half of a
Qwen3-8B-shaped request and the drafter's combine, measured: docs/benchmarks.md#head-slices.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash_dist.model.loss import IGNORE_INDEX

__all__ = ["vocab_slice", "serve_slice", "combine_slices", "ce_from_slices", "slice_stats_columns"]


def slice_stats_columns(picks: int) -> int:
    """fp32 columns of a slice's per-row statistics: its max logit, its sum of exp(logit - max), then the logits of
    the row's ``picks`` asked-for ids (0 where an id is in another slice)."""
    return 2 + int(picks)


def vocab_slice(vocab: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of slice ``index`` of ``parts`` near-equal slices of a vocabulary of ``vocab`` entries."""
    base, extra = divmod(vocab, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


def serve_slice(rows: Tensor, shard: Tensor, lo: int, picks: Tensor, chunk_rows: int
                ) -> tuple[Tensor, Tensor, Tensor]:
    """On a rank holding head rows [lo, lo + len(shard)): rows [R, H], ``picks`` [R, k] the ids whose logits the
    loss needs (the label, k = 1; the target's top-k for KL; ids outside the vocabulary, -100, are no id) ->
    (stats [R, 2 + k] fp32 (``slice_stats_columns``), best ids [R] int64 (global), G [R, H] in the head's dtype),
    chunk by chunk (at most [chunk_rows, V_s] logits alive). No autograd."""
    r, v = rows.shape[0], shard.shape[0]
    step = max(1, int(chunk_rows))
    hc = rows.to(shard.dtype)
    stats = torch.empty(r, slice_stats_columns(picks.shape[1]), dtype=torch.float32, device=rows.device)
    best = torch.empty(r, dtype=torch.int64, device=rows.device)
    g = torch.empty_like(hc)
    local = picks - lo
    owned = (local >= 0) & (local < v)
    local = local.clamp(0, v - 1)
    for a in range(0, r, step):
        b = min(a + step, r)
        z = (hc[a:b] @ shard.t()).float()                                           # [r, V_s]
        top, arg = z.max(-1)                                                        # first id among equal maxima
        stats[a:b, 2:] = z.gather(1, local[a:b]) * owned[a:b]
        p = z.sub_(top[:, None]).exp_()                                             # exp(z - m_s), in place
        stats[a:b, 0], stats[a:b, 1] = top, p.sum(-1)
        best[a:b] = arg + lo
        g[a:b] = p.to(shard.dtype) @ shard
        del z, p
    return stats, best, g


def combine_slices(replies: list) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The slices' replies [(stats, best ids, G)] in vocabulary order -> what one rank over the whole head knows:
    (logsumexp of each row [R] fp32, the logits of its asked-for ids [R, k] fp32, argmax [R], the softmax's part of
    the gradient sum_v softmax(z)_v W_v [R, H] fp32). The objective takes its loss and gradient from these."""
    stats = torch.stack([s for s, _, _ in replies])                                  # [S, R, 2 + k]
    m, sums = stats[..., 0], stats[..., 1]
    big = m.amax(0)                                                                  # [R]
    lse = big + torch.log((sums * torch.exp(m - big)).sum(0))
    ids = torch.stack([b for _, b, _ in replies])                                    # [S, R]
    pred = ids.gather(0, m.argmax(0)[None]).squeeze(0)                               # the lowest slice among equal
    coef = torch.exp(m - lse)                                                        # [S, R]
    soft = sum(c[:, None] * g.float() for c, (_, _, g) in zip(coef, replies))
    return lse, stats[..., 2:].sum(0), pred, soft


def ce_from_slices(replies: list, head: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Cross-entropy on ``labels`` [R] (-100: no loss) from the slices' replies and the whole frozen head [V, H]
    (its labels' rows) -> (CE of each row [R] fp32, 0 where ignored; argmax [R]; d CE / d rows [R, H] fp32, 0 where
    ignored): what ``loss.frozen_head_ce`` returns with weights 1 on the valid rows, per_row."""
    lse, picked, pred, soft = combine_slices(replies)
    has = labels != IGNORE_INDEX
    ce = (lse - picked[:, 0]) * has
    grad = (soft - head[labels.clamp_min(0)].float()) * has[:, None]
    return ce, pred, grad
