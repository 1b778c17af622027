"""KL distillation of the target's next-token distribution (``drafter.loss.kind=kl``).

Each block slot that carries a loss (the same slots, with the same slot weights, as the configured objective's
cross-entropy) is trained towards the target's distribution at its position: the target rank sends its top
``kl_top_k`` next tokens and their probabilities renormalised over those k (p), and the row's loss is

    KL(p || q) = sum_j p_j * (log p_j - log q_j),  q = softmax of the drafter's logits over the WHOLE vocabulary,

so the drafter is pulled towards the target's ranking of its likeliest tokens and away from every other token
(mass outside the k costs through log q's normaliser). With k = 1 it is the CE on the target's greedy token. The
vocab projection runs in row chunks, at most one chunk of [rows, V] logits alive. With a frozen head (training)
each chunk's gradient wrt its rows, w * (sum(p) softmax - p scattered onto its ids) @ W, is computed in the
forward as the CE's fused path does (two matmuls of R x H x V, no recompute in backward); that function is also
what a target serving ``drafter.tuning.loss_on_target`` runs (``serve``), so both give the same numbers. The
accuracy statistics compare the drafter's argmax with the target's greedy token (``labels``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from dflash_dist.config import ConfigError
from dflash_dist.model import head_shards as HS
from dflash_dist.model import loss as L
from dflash_dist.model.lazy_compile import lazy_compile
from dflash_dist.model.objectives.base import Objective, SlotWeightedCE

__all__ = ["DistillKL", "kl_rows", "frozen_head_kl"]


def _chunk_kl(h: Tensor, weight: Tensor, ids: Tensor, p: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """Weighted KL sum and argmax of one row chunk: h [r, H], ids / p [r, k], w [r]. Matmul in the input dtype,
    log-softmax in fp32."""
    logq = F.log_softmax((h @ weight.t()).float(), -1)
    with torch.no_grad():
        pred = logq.argmax(-1)
    lq = logq.gather(1, ids)
    kl = (torch.xlogy(p, p) - p * lq).sum(-1)
    return (kl * w).sum(), pred


def kl_rows(rows_h: Tensor, head: Tensor, ids: Tensor, p: Tensor, w: Tensor, chunk_rows: int
            ) -> tuple[Tensor, Tensor]:
    """(sum_r w_r * KL(p_r || softmax(head @ h_r)), argmax [R]) over rows in chunks of ``chunk_rows`` (each
    checkpointed when a gradient is needed): the path of a trainable head, and the reference of the fused one."""
    grad = torch.is_grad_enabled() and (rows_h.requires_grad or head.requires_grad)
    step = max(1, int(chunk_rows))
    sums, preds = [], []
    for lo in range(0, rows_h.shape[0], step):
        args = (rows_h[lo:lo + step], head, ids[lo:lo + step], p[lo:lo + step], w[lo:lo + step])
        s, pr = checkpoint(_chunk_kl, *args, use_reentrant=False) if grad else _chunk_kl(*args)
        sums.append(s)
        preds.append(pr)
    if not sums:  # no rows: keep the graph connected so backward still works
        return rows_h.sum().float() * 0.0, ids.new_zeros(0)
    return torch.stack(sums).sum(), torch.cat(preds)


def _kl_and_logit_grad(logits: Tensor, ids: Tensor, p: Tensor, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk's (weighted KL of each row [r], argmax [r], d(sum w*KL)/d logits [r, V] in the logits' dtype).
    d KL / d z = sum(p) softmax(z) - p scattered onto its ids (sum(p) is 1 up to rounding). No in-place ops: the
    same function runs eager or through torch.compile."""
    lf = logits.float()
    pred = lf.argmax(-1)
    lse = torch.logsumexp(lf, dim=-1, keepdim=True)
    lq = lf.gather(1, ids) - lse
    kl = (torch.xlogy(p, p) - p * lq).sum(-1) * w
    g = torch.exp(lf - lse) * p.sum(-1, keepdim=True)
    g = g.scatter_add(1, ids, -p) * w[:, None]
    return kl, pred, g.to(logits.dtype)


_kl_and_logit_grad_compiled = lazy_compile(_kl_and_logit_grad, fullgraph=True, dynamic=True)


def frozen_head_kl(h: Tensor, weight: Tensor, ids: Tensor, p: Tensor, w: Tensor, chunk_rows: int,
                   compiled: bool = False, topk: int = 0, topk_out: Optional[list] = None
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """No autograd, rows ``h`` [R, H] through a frozen head [V, H]: (sum_r w_r KL_r fp32 [], argmax [R],
    d(sum)/dh [R, H] in the head's dtype), chunk by chunk (``loss.frozen_head_ce``'s loop with the KL's math,
    ``topk``/``topk_out`` as its)."""
    hc = h.to(weight.dtype)
    grad_h = torch.empty_like(hc)
    sums, preds = [], []
    fn = _kl_and_logit_grad_compiled if compiled else _kl_and_logit_grad
    for lo, hi in L._chunks(hc.shape[0], max(1, int(chunk_rows))):
        logits = hc[lo:hi] @ weight.t()
        if topk:
            topk_out.append(L.grouped_topk(logits, topk))
        kl, pred, g = fn(logits, ids[lo:hi], p[lo:hi], w[lo:hi])
        sums.append(kl.sum())
        preds.append(pred)
        grad_h[lo:hi] = g @ weight
        del g, logits
    loss_sum = torch.stack(sums).sum() if sums else h.new_zeros((), dtype=torch.float32)
    return loss_sum, (torch.cat(preds) if preds else ids.new_zeros(0)), grad_h


class _FrozenHeadKL(torch.autograd.Function):
    """Weighted KL sum over row chunks through a frozen head, the rows' gradient computed in forward."""

    @staticmethod
    def forward(ctx, h, weight, ids, p, w, chunk_rows, compiled, topk=0):
        top_ids: list = []
        loss_sum, pred, grad_h = frozen_head_kl(h.detach(), weight, ids, p, w, chunk_rows, compiled, topk=topk,
                                                topk_out=top_ids)
        ctx.save_for_backward(grad_h)
        ctx.h_dtype = h.dtype
        top = torch.cat(top_ids) if top_ids else pred.new_zeros(pred.shape[0], 0)
        ctx.mark_non_differentiable(pred, top)
        return loss_sum, pred, top

    @staticmethod
    def backward(ctx, grad_loss, _grad_pred, _top):
        (grad_h,) = ctx.saved_tensors
        return (grad_h * grad_loss.to(grad_h.dtype)).to(ctx.h_dtype), None, None, None, None, None, None, None


class DistillKL(Objective):
    """``drafter.loss.kind=kl`` over the configured objective: its slot weights and normaliser, KL in place of CE.
    With ``drafter.tuning.loss_on_target`` a group's request carries its rows' top-k ids and probabilities (k x 12
    bytes per row beside the row's H x 2) and the target runs ``frozen_head_kl`` on them."""

    def __init__(self, spec, base: Objective):
        super().__init__(spec)
        if not isinstance(base, SlotWeightedCE):
            raise ConfigError(f"drafter.loss.kind=kl needs a slot-weighted objective for its weights; "
                              f"drafter.loss.objective={spec.loss.objective!r} is not one")
        if base.weighting == "dpace":
            raise ConfigError("drafter.loss.kind=kl with drafter.loss.weighting=dpace is not supported (D-PACE "
                              "weights come from the CE on one label): set drafter.loss.weighting=decay")
        self.base = base
        self.name = f"kl_{base.name}"
        self.top_k = int(spec.loss.kl_top_k)

    def _soft_rows(self, soft, bsz: int) -> tuple[Tensor, Tensor]:
        """(ids [R, k], probs [R, k] fp32) of the loss rows (``weighted_rows`` order) from the batch's [b, N*B, k]."""
        if soft is None:
            raise RuntimeError("drafter.loss.kind=kl: the batch carries no target distribution")
        ids, probs = (t.reshape(t.shape[0], -1, bsz, t.shape[-1])[:, :, 1:].reshape(-1, t.shape[-1]) for t in soft)
        return ids.contiguous(), probs.float().contiguous()

    def loss(self, hidden: Tensor, lm_head: Tensor, labels: Tensor, soft=None) -> L.LossParts:
        """hidden [b, N*B, H], labels [b, N*B] (the target's greedy tokens, -100: no loss), ``soft`` = (ids, probs)
        [b, N*B, k] from the batch (model/blocks.DrafterBatch.soft). Fused (gradient in forward) when the head is
        frozen and the rows take a gradient, else chunks under checkpoint."""
        slot_w = self.base.slot_weights(labels.device)
        bsz = slot_w.numel()
        rows_h, rows_y, rows_w = L.weighted_rows(hidden, labels, slot_w)
        ids, probs = self._soft_rows(soft, bsz)
        fused = torch.is_grad_enabled() and hidden.requires_grad and not lm_head.requires_grad
        top = None
        if fused and rows_y.numel():
            loss_sum, pred, top = _FrozenHeadKL.apply(rows_h, lm_head, ids, probs, rows_w, self.chunk_rows,
                                                      self.compiled, int(self.head_topk))
        else:
            loss_sum, pred = kl_rows(rows_h, lm_head, ids, probs, rows_w, self.chunk_rows)
        parts = L.slot_stats(loss_sum, pred, rows_y, rows_w, bsz)
        parts.topk_ids = top if self.head_topk and top is not None else None
        return parts

    def rows(self, hidden, labels):
        return L.weighted_rows(hidden, labels, self.base.slot_weights(labels.device))

    def request_inputs(self, labels, soft=None):
        return self._soft_rows(soft, self.block_size)

    def request_specs(self):
        return ((self.top_k, torch.int64), (self.top_k, torch.float32))

    def serve(self, rows, head, labels, ids=None, probs=None):
        w = L.slot_row_weights(labels, self.base.slot_weights(labels.device))
        loss_sum, pred, grad = frozen_head_kl(rows, head, ids, probs, w, self.chunk_rows, self.compiled)
        return loss_sum, pred, grad, None

    vocab_parallel = True

    @property
    def slice_stats_columns(self) -> int:
        return HS.slice_stats_columns(self.top_k)  # the logits of the target's top-k ids

    def serve_slice(self, rows, shard, lo, labels, ids=None, probs=None):
        return HS.serve_slice(rows, shard, lo, ids, self.chunk_rows)

    def combine_slices(self, replies, head, labels, ids=None, probs=None):
        """KL = sum_i p_i (log p_i - z_i + lse); its gradient sum(p) softmax @ W - sum_i p_i W[id_i], weighted."""
        lse, picked, pred, soft = HS.combine_slices(replies)
        w = L.slot_row_weights(labels, self.base.slot_weights(labels.device))
        p = probs.float()
        kl = (torch.xlogy(p, p) - p * (picked - lse[:, None])).sum(-1) * w
        grad = soft * p.sum(-1, keepdim=True)
        for i in range(ids.shape[1]):  # one [R, H] gather at a time (all k at once: k x [R, H])
            grad -= p[:, i:i + 1] * head[ids[:, i]].float()
        return kl.sum(), pred, grad * w[:, None], None

    def describe(self) -> str:
        return f"KL to the target's top-{self.spec.loss.kl_top_k} distribution, weights of {self.base.describe()}"
