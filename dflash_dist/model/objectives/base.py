"""The objective interface and the slot-weighted, chunked cross-entropy most objectives are.

Rows: slots 1..B-1 of every block (slot 0 is the known anchor), in block order (``loss.weighted_rows``). Every
sum an objective returns is a sum over its rows: the trainer divides the step's loss sum by the step's weight sum
over all drafter ranks and groups (one all-reduce), so the update never depends on how the step was split.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from dflash_dist.model import head_shards as HS
from dflash_dist.model import loss as L
from dflash_dist.model.objectives.dpace import dpace_ce, dpace_serve, dpace_weighted, slot_sums
from dflash_dist.model.objectives.registry import OBJECTIVES

__all__ = ["Objective", "SlotWeightedCE"]


@OBJECTIVES.set_base
class Objective:
    """What the trainer and the head server ask of an objective. ``spec``: the resolved drafter description
    (model/spec.py): block size, loss settings (``spec.loss``: chunk rows, compiled, gamma)."""

    name = ""

    head_topk = 0
    """The top-K head ids per loss row a variant asks of the fused loss pass (the trainer sets it from the model's
    ``head_topk``; 0: none). An objective that cannot give them leaves ``LossParts.topk_ids`` None."""

    def __init__(self, spec):
        self.spec = spec
        self.block_size = spec.block_size
        self.chunk_rows = spec.loss.chunk_rows
        self.compiled = spec.loss.compiled

    # ---- the loss of one group of blocks
    def loss(self, hidden: Tensor, lm_head: Tensor, labels: Tensor) -> L.LossParts:
        """A group's LossParts on the drafter: hidden [b, N*B, H] (with its graph), the frozen head [V, H],
        labels [b, N*B] (-100: no loss)."""
        raise NotImplementedError

    # ---- the loss served on a target (drafter.tuning.loss_on_target; comm/head_offload.py moves the tensors)
    def rows(self, hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(rows [R, H], labels [R], weights [R]) of a group, as sent to a target that computes the loss."""
        raise NotImplementedError

    def request_inputs(self, labels: Tensor, soft=None) -> tuple[Tensor, ...]:
        """What else a target needs of a group's rows, one tensor row per loss row (``request_specs``; the batch's
        ``soft``: the target's top-k distribution, kind=kl). Default: nothing."""
        return ()

    def request_specs(self) -> tuple[tuple[int, torch.dtype], ...]:
        """(columns, dtype) of each of ``request_inputs``: what a target allocates to receive them."""
        return ()

    reply_columns = 0
    """fp32 columns per row of ``serve``'s fourth output (0: it returns None)."""

    weights_served = False
    """True when the rows' weights come with the reply (they depend on the loss: D-PACE), so a drafter takes the
    reply before the step's weight sum; False: ``rows``' weights are the loss's, known before any reply."""

    def serve(self, rows: Tensor, head: Tensor, labels: Tensor, *inputs: Tensor
              ) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        """On a target: (loss sum fp32 [], argmax [R], d(loss sum)/d rows [R, H], per-row extras [R,
        reply_columns] fp32 or None) of rows it was sent with ``inputs`` (``request_inputs``); no autograd."""
        raise NotImplementedError

    vocab_parallel = False
    """True when ``serve_slice`` and ``combine_slices`` exist: on a target replica every rank serves its slice of the
    vocabulary and the drafter combines the replies (model/head_shards.py); False: the replica's feeder serves
    the whole head."""

    slice_stats_columns = 0
    """fp32 columns per row of a slice's statistics (the first tensor of ``serve_slice``'s reply, then the ids of
    its best entries [R] int64 and its part of the gradient [R, H] in the rows' dtype)."""

    def serve_slice(self, rows: Tensor, shard: Tensor, lo: int, labels: Tensor, *inputs: Tensor
                    ) -> tuple[Tensor, ...]:
        """On a rank holding head rows [lo, lo + len(shard)): its reply to a request (``head_shards.serve_slice``'s
        tensors); no autograd."""
        raise NotImplementedError(f"{type(self).__name__} has no vocabulary-slice math (vocab_parallel is False): "
                                  "a replica's feeder serves it with the whole head, never through this")

    def combine_slices(self, replies: list, head: Tensor, labels: Tensor, *inputs: Tensor
                       ) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        """On the drafter: the slices' replies, in vocabulary order, its frozen head [V, H] and the request's
        ``inputs`` -> what ``serve`` returns over the whole head (loss sum, argmax, d(loss sum)/d rows, extras)."""
        raise NotImplementedError(f"{type(self).__name__} has no vocabulary-slice math (vocab_parallel is False): "
                                  "a replica's feeder serves it with the whole head, never through this")

    def parts(self, loss_sum: Tensor, pred: Tensor, rows_y: Tensor, rows_w: Tensor,
              extra: Optional[Tensor] = None) -> L.LossParts:
        """The LossParts of a served group from its reply (loss sum tied to the rows' graph, argmax, extras)."""
        return L.slot_stats(loss_sum, pred, rows_y, rows_w, self.block_size)

    # ---- statistics
    def stat_slots(self) -> dict[str, int]:
        """Named statistics this objective adds to the step's accumulator, and their sizes."""
        B = self.block_size
        return {"loss_sum": 1, "weight_sum": 1, "slot_correct": B, "slot_count": B}

    def stats(self, parts: L.LossParts) -> dict[str, Tensor]:
        """A step's values of ``stat_slots`` (device tensors, no sync)."""
        return {"loss_sum": parts.loss_sum.detach(), "weight_sum": parts.weight_sum, "slot_correct": parts.slot_correct,
                "slot_count": parts.slot_count}

    def window_metrics(self, sums: dict[str, list]) -> dict[str, float]:
        """The window's metrics from the all-reduced sums of ``stat_slots``: loss, acc, acc_slot_k and
        tau_from_acc (the accepted length if slots were independent given a correct prefix). ``loss`` and ``acc``
        are required (the progress line shows them)."""
        B = self.block_size
        correct, count = sums["slot_correct"], sums["slot_count"]
        out = {"loss": sums["loss_sum"][0] / max(sums["weight_sum"][0], 1e-9),
               "acc": sum(correct[1:]) / max(sum(count[1:]), 1)}
        for k in range(1, B):
            out[f"acc_slot_{k}"] = correct[k] / max(count[k], 1)
        out["tau_from_acc"] = L.tau_from_slot_acc([out[f"acc_slot_{k}"] for k in range(1, B)])
        return out

    def describe(self) -> str:
        return self.name


class SlotWeightedCE(Objective):
    """Cross-entropy on the data's labels, row weight = its slot's weight (``slot_weights``), vocab projection in
    chunks (``loss.weighted_ce``: fused when the head is frozen). A subclass gives ``slot_weights`` only.
    ``drafter.loss.weighting=dpace`` replaces the slot weights by D-PACE's (objectives/dpace.py), computed from
    the group's own CEs in its forward, so the step's weight sum is still known before any backward; its
    statistics (mean weight and mean confidence per slot) join the window's metrics. Served on a target, D-PACE's
    weights and confidences come back with the reply (``reply_columns``, ``weights_served``)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.weighting = getattr(spec.loss, "weighting", "decay")
        self.dpace_alpha = float(getattr(spec.loss, "dpace_alpha", 0.5))

    def slot_weights(self, device: Optional[torch.device] = None) -> Tensor:
        """[B] fp32 weights of the slots (slot 0 must be 0: it is the anchor)."""
        raise NotImplementedError

    def loss(self, hidden, lm_head, labels):
        if self.weighting == "dpace":
            return dpace_ce(hidden, lm_head, labels, self.block_size, self.dpace_alpha, self.chunk_rows,
                            compiled=self.compiled, topk=self.head_topk)
        return L.weighted_ce(hidden, lm_head, labels, self.slot_weights(labels.device), self.chunk_rows,
                             compiled=self.compiled, topk=self.head_topk)

    def stat_slots(self):
        out = super().stat_slots()
        if self.weighting == "dpace":
            out.update({"dpace_weight": self.block_size, "dpace_q": self.block_size})
        return out

    def stats(self, parts):
        out = super().stats(parts)
        if self.weighting == "dpace":
            out.update({k: parts.stats[k] for k in ("dpace_weight", "dpace_q")})
        return out

    def window_metrics(self, sums):
        out = super().window_metrics(sums)
        if self.weighting == "dpace":
            count = sums["slot_count"]
            for k in range(1, self.block_size):
                out[f"dpace_weight_slot_{k}"] = sums["dpace_weight"][k] / max(count[k], 1)
            out["dpace_q"] = sum(sums["dpace_q"][1:]) / max(sum(count[1:]), 1)
        return out

    def describe(self) -> str:
        return f"{self.name} (D-PACE weights, alpha {self.dpace_alpha:g})" if self.weighting == "dpace" else self.name

    @property
    def weights_served(self) -> bool:
        return self.weighting == "dpace"

    @property
    def reply_columns(self) -> int:
        return 2 if self.weighting == "dpace" else 0   # D-PACE: each row's weight and confidence q

    def rows(self, hidden, labels):
        return L.weighted_rows(hidden, labels, self.slot_weights(labels.device))

    def serve(self, rows, head, labels, *inputs):
        if self.weighting == "dpace":
            loss_sum, pred, grad, w, q = dpace_serve(rows, head, labels, self.block_size, self.dpace_alpha,
                                                     self.chunk_rows, self.compiled)
            return loss_sum, pred, grad, torch.stack([w, q], 1)
        w = L.slot_row_weights(labels, self.slot_weights(labels.device))
        return (*L.frozen_head_ce(rows, head, labels, w, self.chunk_rows, self.compiled), None)

    vocab_parallel = True
    slice_stats_columns = HS.slice_stats_columns(1)  # the label's logit

    def serve_slice(self, rows, shard, lo, labels, *inputs):
        return HS.serve_slice(rows, shard, lo, labels[:, None], self.chunk_rows)

    def combine_slices(self, replies, head, labels, *inputs):
        ce, pred, grad = HS.ce_from_slices(replies, head, labels)   # unweighted: the weights scale CE and gradient
        if self.weighting == "dpace":
            loss_sum, pred, grad, w, q = dpace_weighted(ce, pred, grad, labels != L.IGNORE_INDEX, self.block_size,
                                                        self.dpace_alpha)
            return loss_sum, pred, grad, torch.stack([w, q], 1)
        w = L.slot_row_weights(labels, self.slot_weights(labels.device))
        return (w * ce).sum(), pred, grad * w[:, None], None

    def parts(self, loss_sum, pred, rows_y, rows_w, extra=None):
        if self.weighting != "dpace":
            return super().parts(loss_sum, pred, rows_y, rows_w)
        # the served D-PACE weights replace the slot weights of ``rows``; contiguous: a strided column sums in
        # another order (the weight sum would differ from the local loss's in its last bits)
        w, q = extra[:, 0].contiguous(), extra[:, 1].contiguous()
        parts = L.slot_stats(loss_sum, pred, rows_y, w, self.block_size)
        parts.stats = slot_sums(w, q, self.block_size)
        return parts
