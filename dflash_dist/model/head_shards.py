"""The frozen head's cross-entropy over a vocabulary split in slices (``drafter.tuning.loss_on_target`` on a target
replica: every rank of it serves its slice of the lm_head rows, the drafter combines).

A slice [lo, hi) of the vocabulary sees only its own logits z_s, so each rank returns, per loss row, what no other
slice changes: its max logit m_s, its sum of exp(z_s - m_s), the label's logit where the label is in the slice
(0 elsewhere), the global id of its max, and G_s = exp(z_s - m_s) @ W_s [R, H]. The drafter then
has, exactly as one rank over the whole head would:

    lse = log sum_s exp(m_s) sum_s'     CE = lse - z_label     argmax: the best logit, the lowest id among equal
    d CE / d h = sum_s exp(m_s - lse) G_s - W[label]      (W[label]: a row of the drafter's own frozen head)

Each slice's reply is independent of the others (no collective between the replica's ranks), so every rank serves
its requests at its own boundaries. The weights of the rows multiply CE and its gradient, so the objective applies
them after ``combine`` (decay's slot weights or D-PACE's, which depend on the combined CE). One rank's half of a
Qwen3-8B-shaped request and the drafter's combine, measured: docs/benchmarks.md#head-slices.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash_dist.model.loss import IGNORE_INDEX

__all__ = ["vocab_slice", "serve_slice", "combine_slices", "SLICE_STATS"]

SLICE_STATS = 3
"""fp32 columns of a slice's per-row statistics: max logit, sum of exp(logit - max), label logit."""


def vocab_slice(vocab: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of slice ``index`` of ``parts`` near-equal slices of a vocabulary of ``vocab`` entries."""
    base, extra = divmod(vocab, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


def serve_slice(rows: Tensor, shard: Tensor, lo: int, labels: Tensor, chunk_rows: int
                ) -> tuple[Tensor, Tensor, Tensor]:
    """On a rank holding head rows [lo, lo + len(shard)): rows [R, H], labels [R] (-100: no loss) ->
    (stats [R, SLICE_STATS] fp32, best ids [R] int64 (global), G [R, H] in the head's dtype), chunk by chunk
    (at most [chunk_rows, V_s] logits alive). No autograd."""
    r, v = rows.shape[0], shard.shape[0]
    hc = rows.to(shard.dtype)
    stats = torch.empty(r, SLICE_STATS, dtype=torch.float32, device=rows.device)
    best = torch.empty(r, dtype=torch.int64, device=rows.device)
    g = torch.empty_like(hc)
    local = labels - lo
    owned = (local >= 0) & (local < v)
    for a in range(0, r, max(1, int(chunk_rows))):
        b = min(a + max(1, int(chunk_rows)), r)
        z = (hc[a:b] @ shard.t()).float()                                           # [r, V_s]
        top, arg = z.max(-1)                                                        # first id among equal maxima
        picked = z.gather(1, local[a:b].clamp(0, v - 1)[:, None]).squeeze(1) * owned[a:b]
        p = z.sub_(top[:, None]).exp_()                                             # exp(z - m_s), in place
        stats[a:b, 0], stats[a:b, 1], stats[a:b, 2] = top, p.sum(-1), picked
        best[a:b] = arg + lo
        g[a:b] = p.to(shard.dtype) @ shard
        del z, p
    return stats, best, g


def combine_slices(replies: list, head: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The slices' replies [(stats, best ids, G)] in vocabulary order, the whole frozen head [V, H] (for the labels'
    rows) and the labels [R] -> (CE of each row [R] fp32, 0 where ignored; argmax [R]; d CE / d rows [R, H] fp32,
    0 where ignored): what ``loss.frozen_head_ce`` returns with weights 1 on the valid rows, per_row."""
    stats = torch.stack([s for s, _, _ in replies])                                  # [S, R, 4]
    m, sums, picked = stats.unbind(-1)
    big = m.amax(0)                                                                  # [R]
    lse = big + torch.log((sums * torch.exp(m - big)).sum(0))
    has = labels != IGNORE_INDEX
    ce = (lse - picked.sum(0)) * has
    ids = torch.stack([b for _, b, _ in replies])                                    # [S, R]
    first = m.argmax(0)                                                              # the lowest slice among equal
    pred = ids.gather(0, first[None]).squeeze(0)
    coef = torch.exp(m - lse) * has                                                  # [S, R]
    grad = sum(c[:, None] * g.float() for c, (_, _, g) in zip(coef, replies))
    grad = grad - head[labels.clamp_min(0)].float() * has[:, None]
    return ce, pred, grad
