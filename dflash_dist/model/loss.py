"""Slot weights and the chunked, weighted cross-entropy of the DFlash drafter (the math objectives are built from).

Slot k of a block predicts the token k positions after the anchor. Later slots matter less for acceptance
length (a draft is accepted only up to its first miss), so slot k >= 1 gets weight exp(-(k-1)/gamma) and slot
0 (the known anchor) gets 0. The loss is sum(w * CE) / sum(w); this module returns the two sums separately
so the caller can normalise by a global (all-reduced) weight sum. The functions take the per-slot weights
[B] (``weighted_ce``, ``weighted_rows``, ``slot_row_weights``) or, as before, the decay gamma (``decayed_ce``,
``loss_rows``, ``row_weights``); the objective objects (model/objectives/) pick the weights.

The vocab projection is the memory peak ([rows, V] fp32 logits with V ~ 150k), so rows are processed in
chunks and at most one chunk of logits is alive at a time. Two ways, same numbers:

* ``fused`` (the default when the lm_head is frozen, i.e. always in training): each chunk's gradient with
  respect to the hidden rows, (softmax - onehot) * w @ W, is computed right after its loss in the forward
  pass and kept ([rows, H], small); backward only scales it. No logits are recomputed: this saves the third
  lm_head matmul that checkpointing pays (about 12% of a Qwen3-8B-shaped drafter step's FLOPs).
* ``checkpoint``: each chunk under torch.utils.checkpoint, its logits recomputed in backward. Needed when the
  head itself takes a gradient; kept as the reference the fused path is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from dflash_dist.model.lazy_compile import LazyCompiled, lazy_compile

__all__ = ["slot_weights", "LossParts", "decayed_ce", "weighted_ce", "frozen_head_ce", "loss_rows", "weighted_rows",
           "row_weights", "slot_row_weights", "slot_stats", "grouped_topk"]

IGNORE_INDEX = -100


def slot_weights(block_size: int, gamma: float, device=None) -> Tensor:
    """[B] fp32: 0 for slot 0, exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    w = torch.exp(-(k - 1.0) / float(gamma))
    return torch.where(k == 0, torch.zeros_like(w), w)  # not w[0] = 0.0: a scalar copy that syncs on CUDA


@dataclass
class LossParts:
    """Weighted CE sum (carries grad), weight sum, per-slot correct / label counts [B] (int64, no grad);
    ``extra``: a variant's own loss terms by name (sums, already included in ``loss_sum``), for its statistics;
    ``stats``: the objective's own statistics by name (sums, device tensors; ``Objective.stats`` reads them);
    ``row_weights``: the detached weight of each loss row of one group (``weighted_rows`` order), for a variant's
    loss term weighted like the base loss (None once several groups are summed); ``topk_ids``: the top-K ids
    [rows, K] of each loss row's head logits, taken from the fused pass's own logits when asked (``weighted_ce``'s
    ``topk``; None otherwise)."""

    loss_sum: Tensor
    weight_sum: Tensor
    slot_correct: Tensor
    slot_count: Tensor
    extra: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    row_weights: Optional[Tensor] = None
    topk_ids: Optional[Tensor] = None

    @staticmethod
    def total(parts: list["LossParts"]) -> "LossParts":
        """The sums of several parts (the micro-batches of one step)."""
        if len(parts) == 1:
            return parts[0]
        extra = {k: sum(p.extra[k] for p in parts) for k in parts[0].extra}
        stats = {k: sum(p.stats[k] for p in parts) for k in parts[0].stats}
        return LossParts(*(sum(getattr(p, f) for p in parts)
                           for f in ("loss_sum", "weight_sum", "slot_correct", "slot_count")), extra=extra,
                         stats=stats)

    def loss(self) -> Tensor:
        """Local normalisation, sum(w*CE)/sum(w) (0 when nothing is supervised)."""
        return self.loss_sum / self.weight_sum.clamp_min(torch.finfo(torch.float32).tiny)


def _chunk_ce(h: Tensor, weight: Tensor, labels: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """Weighted CE sum and argmax of one row chunk. Matmul in the input dtype, softmax/CE in fp32."""
    logits = (h @ weight.t()).float()
    ce = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
    with torch.no_grad():
        pred = logits.argmax(-1)
    return (ce * w).sum(), pred


def _ce_stats(lf: Tensor, y: Tensor, wt: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fp32 logits [r, V] -> (weighted CE of each row [r], argmax, logsumexp, labels with ignored rows at 0)."""
    pred = lf.argmax(-1)
    lse = torch.logsumexp(lf, dim=-1)
    y_safe = y.clamp_min(0)
    picked = lf.gather(1, y_safe[:, None]).squeeze(1)
    return (lse - picked) * wt, pred, lse, y_safe                    # wt is 0 where y is ignored


def _ce_and_logit_grad_eager(logits: Tensor, y: Tensor, wt: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk's (weighted CE of each row, argmax, d(sum w*CE)/d logits = w * (softmax - onehot) in the logits' dtype).
    Eager: fp32 copy of the logits, then in place over it (one [r, V] fp32 buffer alive)."""
    lf = logits.float()                                                         # [r, V]
    loss, pred, lse, y_safe = _ce_stats(lf, y, wt)
    g = lf.sub_(lse[:, None]).exp_().mul_(wt[:, None])
    g.scatter_add_(1, y_safe[:, None], -wt[:, None])
    return loss, pred, g.to(logits.dtype)


def _ce_and_logit_grad(logits: Tensor, y: Tensor, wt: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The same math without in-place ops, for torch.compile: inductor fuses the fp32 upcast, the reductions and
    the softmax gradient into a few passes over the bf16 logits (the eager chain makes ~10 passes over an fp32
    copy; the compiled chunk against the eager one, measured: docs/benchmarks.md#drafter-step). The one-hot is a
    comparison, never stored."""
    lf = logits.float()
    loss, pred, lse, y_safe = _ce_stats(lf, y, wt)
    onehot = torch.arange(lf.shape[1], device=lf.device)[None, :] == y_safe[:, None]
    g = (torch.exp(lf - lse[:, None]) - onehot.float()) * wt[:, None]
    return loss, pred, g.to(logits.dtype)


# dynamic: one graph for every chunk height (a height of 1 would specialise: _chunks never makes one)
_ce_and_logit_grad_compiled = lazy_compile(_ce_and_logit_grad, fullgraph=True, dynamic=True)


TOPK_GROUP = 128
"""Vocabulary entries per group of ``grouped_topk``'s first pass."""


def grouped_topk(logits: Tensor, k: int, group: int = TOPK_GROUP) -> Tensor:
    """The ids [..., k] of ``logits.topk(k)`` (best first), in two small passes instead of a radix select over the
    whole vocabulary (~10 ms of a DFlash2 step at 151,936 entries on an H200): the max of every group of ``group``
    entries, the top-k groups by it, then the top-k of those k*group entries. Exact: an entry of the top-k is at
    least the k-th largest value, so its group's max is too, and at most k groups hold such a max (ties between
    equal values may pick other ids than ``topk`` would; torch does not fix that order either). Measured:
    docs/benchmarks.md#drafter-step-profile."""
    v = logits.shape[-1]
    if k * group >= v:
        return logits.topk(k, dim=-1).indices
    pad = -v % group
    x = F.pad(logits, (0, pad), value=float("-inf")) if pad else logits
    groups = x.unflatten(-1, (-1, group))                                              # [..., G, group]
    best = groups.amax(-1).topk(k, dim=-1).indices                                     # [..., k] group ids
    picked = groups.gather(-2, best[..., None].expand(*best.shape, group))            # [..., k, group]
    local = picked.flatten(-2).topk(k, dim=-1).indices                                 # [..., k] in k*group
    return best.gather(-1, local // group) * group + local % group


_CE_GRAD_TOPK: dict[int, LazyCompiled] = {}


def _ce_grad_topk_compiled(k: int) -> LazyCompiled:
    """``_ce_and_logit_grad`` plus ``grouped_topk(logits, k)`` as a fourth output, compiled once per k (a closure:
    k stays a constant, never a dynamic size). Eager, the group maxima are a bf16 reduction of their own over the
    chunk's logits (measured: docs/benchmarks.md#dflash2-step)."""
    if k not in _CE_GRAD_TOPK:
        def fn(logits: Tensor, y: Tensor, wt: Tensor):
            return (*_ce_and_logit_grad(logits, y, wt), grouped_topk(logits, k))
        _CE_GRAD_TOPK[k] = lazy_compile(fn, fullgraph=True, dynamic=True)
    return _CE_GRAD_TOPK[k]


def _chunks(rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of at most chunk_rows, a trailing 1-row chunk merged into the one before it."""
    bounds = [(lo, min(lo + chunk_rows, rows)) for lo in range(0, rows, chunk_rows)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], rows)]
    return bounds


def frozen_head_ce(h: Tensor, weight: Tensor, labels: Tensor, w: Tensor, chunk_rows: int, compiled: bool,
                   per_row: bool = False, topk: int = 0, topk_out: Optional[list] = None
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Weighted CE sum of rows ``h`` [R, H] through a frozen head [V, H], chunk by chunk: (loss sum fp32 [],
    argmax [R], d(loss sum)/dh [R, H] in the head's dtype). No autograd; what the drafter's fused loss runs,
    and what a target rank runs for it with ``drafter.tuning.loss_on_target`` (head_offload.py). ``per_row``:
    the weighted CE of each row [R] instead of their sum (an objective whose weights depend on the CE,
    D-PACE, weights the rows afterwards: the gradient of each row is linear in its weight). ``topk`` > 0: the
    top-``topk`` ids of every chunk's logits are appended to ``topk_out`` (a variant that re-ranks the head's
    top-K, DFlash2, then needs no second pass over the vocabulary)."""
    hc = h.to(weight.dtype)
    grad_h = torch.empty_like(hc)
    sums, preds = [], []
    chunk_fn = _ce_and_logit_grad_compiled if compiled else _ce_and_logit_grad_eager
    if compiled and topk:  # the top-K in the same compiled graph: its group maxima in triton, not eager reductions
        chunk_fn = _ce_grad_topk_compiled(int(topk))
    for lo, hi in _chunks(hc.shape[0], chunk_rows):
        logits = hc[lo:hi] @ weight.t()                                         # [r, V], the head's dtype
        if topk and not compiled:  # before chunk_fn: the eager one works in place over fp32 logits
            topk_out.append(grouped_topk(logits, topk))
        loss, pred, g, *top = chunk_fn(logits, labels[lo:hi], w[lo:hi])
        if top:
            topk_out.append(top[0])
        sums.append(loss if per_row else loss.sum())
        preds.append(pred)
        grad_h[lo:hi] = g @ weight
        del logits, g
    if per_row:
        loss_sum = torch.cat(sums) if sums else h.new_zeros((0,), dtype=torch.float32)
    else:
        loss_sum = torch.stack(sums).sum() if sums else h.new_zeros((), dtype=torch.float32)
    pred = torch.cat(preds) if preds else labels.clone()
    return loss_sum, pred, grad_h


class _FrozenHeadCE(torch.autograd.Function):
    """Weighted CE sum over row chunks through a frozen head, gradient wrt the rows computed in forward."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, labels: Tensor, w: Tensor, chunk_rows: int, compiled: bool,
                topk: int = 0):
        ids: list = []
        loss_sum, pred, grad_h = frozen_head_ce(h.detach(), weight, labels, w, chunk_rows, compiled, topk=topk,
                                                topk_out=ids)
        ctx.save_for_backward(grad_h)
        ctx.h_dtype = h.dtype
        top = torch.cat(ids) if ids else pred.new_zeros(pred.shape[0], 0)
        ctx.mark_non_differentiable(pred, top)
        return loss_sum, pred, top

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_pred, _grad_top):
        (grad_h,) = ctx.saved_tensors
        return (grad_h * grad_loss.to(grad_h.dtype)).to(ctx.h_dtype), None, None, None, None, None, None


def decayed_ce(hidden: Tensor, lm_head_weight: Tensor, labels: Tensor, block_size: int, gamma: float,
               chunk_rows: int, mode: str = "auto", compiled: bool = False) -> LossParts:
    """Decayed cross-entropy: ``weighted_ce`` with the slot weights exp(-(k-1)/gamma)."""
    return weighted_ce(hidden, lm_head_weight, labels, slot_weights(block_size, gamma, device=labels.device),
                       chunk_rows, mode=mode, compiled=compiled)


def weighted_ce(hidden: Tensor, lm_head_weight: Tensor, labels: Tensor, slot_w: Tensor, chunk_rows: int,
                mode: str = "auto", compiled: bool = False, rows_w: Optional[Tensor] = None, topk: int = 0
                ) -> LossParts:
    """Slot-weighted cross-entropy of drafter outputs through the (frozen) target lm_head; ``slot_w`` [B] fp32 on
    the labels' device (slot 0 is never supervised).

    hidden [b, N*B, H], lm_head_weight [V, H], labels [b, N*B] (-100 = no loss). Slot-0 rows never carry a
    loss, so they are dropped before the projection (static slicing, no sync). No .item(): every output is a
    tensor on hidden's device.
    ``mode``: fused, checkpoint, or auto (fused when the head is frozen and hidden needs
    a gradient; see the module docstring). ``compiled``: the fused path's per-chunk softmax/CE/gradient runs
    through torch.compile (``drafter.tuning.compile_loss``; same math as the eager chain, fewer passes over the logits).
    ``rows_w``: the weight of each loss row (``weighted_rows`` order) instead of its slot's.
    ``topk`` > 0: the fused path also returns each row's top-``topk`` head ids (``LossParts.topk_ids``).
    """
    block_size = slot_w.numel()
    rows_h, rows_y, slot_rows_w = weighted_rows(hidden, labels, slot_w)
    rows_w = slot_rows_w if rows_w is None else rows_w
    if mode not in ("auto", "fused", "checkpoint"):
        raise ValueError(f"mode={mode!r}: use auto, fused or checkpoint")
    grad = torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad)
    fused = grad and not lm_head_weight.requires_grad and mode in ("auto", "fused")
    if mode == "fused" and grad and lm_head_weight.requires_grad:
        raise ValueError("the fused loss needs a frozen lm_head (lm_head_weight.requires_grad is True)")
    use_ckpt = grad and not fused
    sums, preds = [], []
    step = max(1, int(chunk_rows))
    top = None
    if fused and rows_y.numel():
        loss_sum, pred, top = _FrozenHeadCE.apply(rows_h, lm_head_weight, rows_y, rows_w, step, compiled, int(topk))
        sums = None
    for lo in range(0, rows_y.numel() if sums is not None else 0, step):
        args = (rows_h[lo:lo + step], lm_head_weight, rows_y[lo:lo + step], rows_w[lo:lo + step])
        s, p = checkpoint(_chunk_ce, *args, use_reentrant=False) if use_ckpt else _chunk_ce(*args)
        sums.append(s)
        preds.append(p)
    if sums is None:
        pass  # fused: loss_sum and pred already computed
    elif sums:
        loss_sum = torch.stack(sums).sum()
        pred = torch.cat(preds)
    else:  # no rows at all (N == 0): keep the graph connected so backward still works
        loss_sum = hidden.sum().float() * 0.0
        pred = rows_y.clone()

    parts = slot_stats(loss_sum, pred, rows_y, rows_w, block_size)
    parts.topk_ids = top if topk and top is not None else None
    return parts


def loss_rows(hidden: Tensor, labels: Tensor, block_size: int, gamma: float) -> tuple[Tensor, Tensor, Tensor]:
    """``weighted_rows`` with the decay weights of ``gamma``."""
    return weighted_rows(hidden, labels, slot_weights(block_size, gamma, device=labels.device))


def weighted_rows(hidden: Tensor, labels: Tensor, slot_w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The rows that can carry a loss: slots 1..B-1 of every block (B = len(slot_w)). hidden [b, N*B, H], labels
    [b, N*B] -> (rows [b*N*(B-1), H], labels [rows], weights [rows] fp32: the slot's weight, 0 where ignored).
    Static slicing: no host sync."""
    b, q, h_dim = hidden.shape
    bsz = slot_w.numel()
    if q % bsz:
        raise ValueError(f"hidden has {q} rows per sample, not a multiple of block_size={bsz}")
    if labels.shape != (b, q):
        raise ValueError(f"labels {tuple(labels.shape)} must be [b, N*B] = {(b, q)}")
    rows_h = hidden.reshape(b, q // bsz, bsz, h_dim)[:, :, 1:].reshape(-1, h_dim)
    rows_y = labels.reshape(b, q // bsz, bsz)[:, :, 1:].reshape(-1)
    return rows_h, rows_y, slot_row_weights(rows_y, slot_w)


def row_weights(rows_y: Tensor, block_size: int, gamma: float) -> Tensor:
    """``slot_row_weights`` with the decay weights of ``gamma``."""
    return slot_row_weights(rows_y, slot_weights(block_size, gamma, device=rows_y.device))


def slot_row_weights(rows_y: Tensor, slot_w: Tensor) -> Tensor:
    """Weight of each loss row (rows in block order, B-1 per block): its slot's, 0 where the label is ignored."""
    return slot_w[1:].repeat(rows_y.numel() // (slot_w.numel() - 1)) * (rows_y != IGNORE_INDEX)


def slot_stats(loss_sum: Tensor, pred: Tensor, rows_y: Tensor, rows_w: Tensor, block_size: int) -> LossParts:
    """LossParts from a loss sum and the argmax of every loss row (``loss_rows`` order): weight sum and per-slot
    correct / label counts, on the device, no sync."""
    bsz = block_size
    has = rows_y != IGNORE_INDEX
    nblk = rows_y.numel() // (bsz - 1)
    with torch.no_grad():
        correct = ((pred == rows_y) & has).view(nblk, bsz - 1).sum(0)
        count = has.view(nblk, bsz - 1).sum(0)
        zero = torch.zeros(1, dtype=torch.long, device=rows_y.device)
        slot_correct = torch.cat([zero, correct.long()])
        slot_count = torch.cat([zero, count.long()])
        weight_sum = rows_w.sum()
    return LossParts(loss_sum=loss_sum, weight_sum=weight_sum, slot_correct=slot_correct, slot_count=slot_count,
                     row_weights=rows_w.detach())


def tau_from_slot_acc(acc: list) -> float:
    """The acceptance length per-slot accuracies predict (slots 1..B-1 in order) if each slot were right
    independently of the others given a right prefix: 1 + a1 + a1 a2 + ..."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau
