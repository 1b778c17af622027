"""KL distillation of the target's next-token distribution (``drafter.loss.kind=kl``).

Each block slot that carries a loss (the same slots, with the same slot weights, as the configured objective's
cross-entropy) is trained towards the target's distribution at its position: the target rank sends its top
``kl_top_k`` next tokens and their probabilities renormalised over those k (p), and the row's loss is

    KL(p || q) = sum_j p_j * (log p_j - log q_j),  q = softmax of the drafter's logits over the WHOLE vocabulary,

so the drafter is pulled towards the target's ranking of its likeliest tokens and away from every other token
(mass outside the k costs through log q's normaliser). With k = 1 it is the CE on the target's greedy token. The
vocab projection runs in row chunks, each checkpointed, as the CE's does: [rows, V] logits never exist at once.
The accuracy statistics compare the drafter's argmax with the target's greedy token (``labels``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from dflash_dist.config import ConfigError
from dflash_dist.model import loss as L
from dflash_dist.model.objectives.base import Objective, SlotWeightedCE

__all__ = ["DistillKL", "kl_rows"]


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
    checkpointed when a gradient is needed)."""
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


class DistillKL(Objective):
    """``drafter.loss.kind=kl`` over the configured objective: its slot weights and normaliser, KL in place of CE."""

    def __init__(self, spec, base: Objective):
        super().__init__(spec)
        if not isinstance(base, SlotWeightedCE):
            raise ConfigError(f"drafter.loss.kind=kl needs a slot-weighted objective for its weights; "
                              f"drafter.loss.objective={spec.loss.objective!r} is not one")
        self.base = base
        self.name = f"kl_{base.name}"

    def loss(self, hidden: Tensor, lm_head: Tensor, labels: Tensor, soft=None) -> L.LossParts:
        """hidden [b, N*B, H], labels [b, N*B] (the target's greedy tokens, -100: no loss), ``soft`` = (ids, probs)
        [b, N*B, k] from the batch (model/blocks.DrafterBatch.soft)."""
        if soft is None:
            raise RuntimeError("drafter.loss.kind=kl: the batch carries no target distribution")
        slot_w = self.base.slot_weights(labels.device)
        bsz = slot_w.numel()
        rows_h, rows_y, rows_w = L.weighted_rows(hidden, labels, slot_w)
        ids, probs = (t.reshape(t.shape[0], -1, bsz, t.shape[-1])[:, :, 1:].reshape(-1, t.shape[-1]) for t in soft)
        loss_sum, pred = kl_rows(rows_h, lm_head, ids, probs.float(), rows_w, self.chunk_rows)
        return L.slot_stats(loss_sum, pred, rows_y, rows_w, bsz)

    def describe(self) -> str:
        return f"KL to the target's top-{self.spec.loss.kl_top_k} distribution, weights of {self.base.describe()}"
