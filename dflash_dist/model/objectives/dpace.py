"""D-PACE position weights (arXiv 2605.18810; ``drafter.loss.weighting=dpace``) and their fused, chunked CE.

Per block, from the drafter's own detached confidence on each label q_i = exp(-CE_i) and the valid mask m:
q~_i = (1-alpha) q_i + alpha (1 where m_i = 0 and at the anchor slot), C_j = prod_{i<=j} q~_i,
w_j = m_j sum_{t>=j} m_t C_t; the loss sum is sum_j w_j CE_j, the weights carry no gradient.

The weights need the CE of every slot of a block before any row's gradient is weighted. The fused path needs no
second pass: each chunk's gradient wrt its rows, (softmax - onehot) @ W, is computed unweighted in the forward
(as ``loss.frozen_head_ce`` does, at most one chunk of [rows, V] logits alive) and is linear in the row's weight,
so the rows are scaled once all CEs are known ([rows, H] kept, the same memory as the decayed loss).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from dflash_dist.model import loss as L

__all__ = ["dpace_weights", "dpace_ce", "dpace_serve", "dpace_weighted"]


def dpace_weights(ce: Tensor, has: Tensor, block_size: int, alpha: float) -> Tensor:
    """D-PACE weight of each loss row: ``ce`` [R] fp32 and ``has`` [R] bool (valid label) in block order, B-1
    rows per block (slots 1..B-1; the anchor's q~ = 1 changes no product). Returns [R] fp32, detached."""
    with torch.no_grad():
        shape = (-1, block_size - 1)
        m = has.reshape(shape).float()
        q = torch.exp(-ce.detach().float()).reshape(shape)
        smooth = torch.where(m > 0, (1.0 - alpha) * q + alpha, torch.ones_like(q))
        prefix = torch.cumprod(smooth, dim=-1)                                    # C_j
        suffix = (prefix * m).flip(-1).cumsum(-1).flip(-1)                        # sum_{t>=j} m_t C_t
        return (suffix * m).reshape(-1)


def dpace_weighted(ce_rows, pred, grad_h, has, block_size, alpha):
    """(loss sum, argmax, grad wrt the rows, weights, q) from the unweighted CE and gradient of every row (the
    gradient is scaled in place)."""
    w = dpace_weights(ce_rows, has, block_size, alpha)
    grad_h.mul_(w[:, None].to(grad_h.dtype))
    q = torch.exp(-ce_rows) * has
    return (w * ce_rows).sum(), pred, grad_h, w, q


def dpace_serve(rows: Tensor, head: Tensor, labels: Tensor, block_size: int, alpha: float, chunk_rows: int,
                compiled: bool, topk: int = 0, topk_out: Optional[list] = None):
    """No autograd, rows [R, H] through a frozen head [V, H]: (loss sum fp32 [], argmax [R], d(loss sum)/d rows
    [R, H], weights [R], q [R]) in one chunked pass over the vocab (``topk``/``topk_out``: as
    ``loss.frozen_head_ce``'s)."""
    has = labels != L.IGNORE_INDEX
    ce, pred, grad_h = L.frozen_head_ce(rows, head, labels, has.float(), chunk_rows, compiled, per_row=True,
                                        topk=topk, topk_out=topk_out)
    return dpace_weighted(ce, pred, grad_h, has, block_size, alpha)


class _DPaceFrozenHeadCE(torch.autograd.Function):
    """D-PACE-weighted CE sum over row chunks through a frozen head, the rows' gradient computed in forward."""

    @staticmethod
    def forward(ctx, h, weight, labels, block_size, alpha, chunk_rows, compiled, topk=0):
        ids: list = []
        loss_sum, pred, grad_h, w, q = dpace_serve(h.detach(), weight, labels, block_size, alpha, chunk_rows,
                                                   compiled, topk=topk, topk_out=ids)
        ctx.save_for_backward(grad_h)
        ctx.h_dtype = h.dtype
        top = torch.cat(ids) if ids else pred.new_zeros(pred.shape[0], 0)
        ctx.mark_non_differentiable(pred, w, q, top)
        return loss_sum, pred, w, q, top

    @staticmethod
    def backward(ctx, grad_loss, _pred, _w, _q, _top):
        (grad_h,) = ctx.saved_tensors
        return (grad_h * grad_loss.to(grad_h.dtype)).to(ctx.h_dtype), None, None, None, None, None, None, None


def _plain_row_ce(rows_h: Tensor, head: Tensor, rows_y: Tensor, chunk_rows: int) -> Tensor:
    """Detached CE of each row, chunk by chunk (the first pass when the fused path does not apply)."""
    out = []
    with torch.no_grad():
        for lo in range(0, rows_y.numel(), max(1, chunk_rows)):
            logits = (rows_h[lo:lo + chunk_rows] @ head.t()).float()
            out.append(torch.nn.functional.cross_entropy(logits, rows_y[lo:lo + chunk_rows],
                                                         ignore_index=L.IGNORE_INDEX, reduction="none"))
    return torch.cat(out) if out else rows_h.new_zeros((0,), dtype=torch.float32)


def dpace_ce(hidden: Tensor, lm_head: Tensor, labels: Tensor, block_size: int, alpha: float, chunk_rows: int,
             compiled: bool = False, topk: int = 0) -> L.LossParts:
    """A group's D-PACE LossParts: hidden [b, N*B, H], the head [V, H], labels [b, N*B]. Fused (one pass) when
    the head is frozen and the rows take a gradient; otherwise (no grad, a trainable head) a detached first
    pass gives the weights and ``loss.weighted_ce`` runs with them. ``stats``: per slot, the weight sum
    (``dpace_weight``) and the confidence sum (``dpace_q``). ``topk`` > 0: the fused pass also gives each row's
    top-``topk`` head ids (``LossParts.topk_ids``, as ``loss.weighted_ce``)."""
    ones = torch.ones(block_size, device=labels.device)
    rows_h, rows_y, _ = L.weighted_rows(hidden, labels, ones)
    has = rows_y != L.IGNORE_INDEX
    fused = torch.is_grad_enabled() and hidden.requires_grad and not lm_head.requires_grad
    if fused and rows_y.numel():
        loss_sum, pred, w, q, top = _DPaceFrozenHeadCE.apply(rows_h, lm_head, rows_y, block_size, float(alpha),
                                                             max(1, int(chunk_rows)), compiled, int(topk))
        parts = L.slot_stats(loss_sum, pred, rows_y, w, block_size)
        parts.topk_ids = top if topk else None
    else:
        ce = _plain_row_ce(rows_h.detach(), lm_head.detach(), rows_y, int(chunk_rows))
        w = dpace_weights(ce, has, block_size, alpha)
        q = torch.exp(-ce) * has
        parts = L.weighted_ce(hidden, lm_head, labels, ones, chunk_rows, compiled=compiled, rows_w=w)
    parts.stats = slot_sums(w, q, block_size)
    return parts


def slot_sums(w: Tensor, q: Tensor, block_size: int) -> dict:
    """Per-slot sums [B] (slot 0: 0) of the weights and confidences of rows in block order."""
    zero = w.new_zeros(1)
    per = (lambda x: torch.cat([zero, x.detach().float().reshape(-1, block_size - 1).sum(0)]))
    return {"dpace_weight": per(w), "dpace_q": per(q)}
