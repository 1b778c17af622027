"""drafter.loss.kind=kl: KL(target top-k, renormalised || drafter) on the block slots, against a dense reference."""

import pytest
import torch
import torch.nn.functional as F

from dflash_dist.model import loss as L
from dflash_dist.model.objectives.decayed_ce import DecayedCE
from dflash_dist.model.objectives.distill import DistillKL
from dflash_dist.model.spec import LossSpec


class _Spec:
    block_size = 4

    def __init__(self, k, chunk_rows=5):
        self.loss = LossSpec("decayed_ce", None, chunk_rows, False, labels="target", kind="kl", kl_top_k=k)


def _case(k, b=2, n=3, bsz=4, v=50, h=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, n * bsz, h, generator=g, requires_grad=True)
    head = torch.randn(v, h, generator=g) * 0.3
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(b * n * bsz)]).view(b, n * bsz, k)
    probs = torch.softmax(torch.randn(b, n * bsz, k, generator=g), -1)
    labels = ids[..., 0].clone()
    labels[0, 5] = L.IGNORE_INDEX                      # an unsupervised slot
    labels[:, ::bsz] = L.IGNORE_INDEX                  # slot 0 never carries a loss
    return hidden, head, labels, (ids, probs)


def _dense_reference(hidden, head, labels, soft, slot_w):
    """sum over slots 1..B-1 of w_slot * sum_v p_v (log p_v - log q_v), p scattered densely over the vocabulary."""
    ids, probs = soft
    b, q, _ = hidden.shape
    bsz = slot_w.numel()
    logq = F.log_softmax((hidden @ head.t()).float(), -1)                       # [b, Q, V]
    p = torch.zeros_like(logq).scatter(-1, ids, probs)
    kl = (torch.xlogy(p, p) - p * logq).sum(-1)                                 # [b, Q]
    w = slot_w.repeat(q // bsz).expand(b, q) * (labels != L.IGNORE_INDEX)
    return (kl * w).sum(), w.sum()


@pytest.mark.parametrize("k", [1, 4])
def test_kl_equals_the_dense_reference(k):
    hidden, head, labels, soft = _case(k)
    obj = DistillKL(_Spec(k), DecayedCE(_Spec(k)))
    parts = obj.loss(hidden, head, labels, soft)
    (g,) = torch.autograd.grad(parts.loss_sum, hidden)
    ref, wsum = _dense_reference(hidden, head, labels, soft, obj.base.slot_weights())
    (g_ref,) = torch.autograd.grad(ref, hidden)
    torch.testing.assert_close(parts.loss_sum, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts.weight_sum, wsum)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
    assert parts.loss_sum > 0 and int(parts.slot_count.sum()) == int((labels != L.IGNORE_INDEX).sum())


def test_kl_of_one_token_is_the_ce_on_the_targets_greedy_token():
    hidden, head, labels, soft = _case(1)
    kl = DistillKL(_Spec(1), DecayedCE(_Spec(1))).loss(hidden, head, labels, soft)
    ce = DecayedCE(_Spec(1)).loss(hidden, head, labels)
    torch.testing.assert_close(kl.loss_sum, ce.loss_sum, rtol=1e-5, atol=1e-5)
    assert torch.equal(kl.slot_correct, ce.slot_correct)


def test_kl_is_zero_when_the_drafter_is_the_target():
    """A drafter whose softmax equals p (mass only on the k tokens, up to the fp32 floor) has no loss."""
    hidden, head, labels, (ids, probs) = _case(3, v=20, h=20)
    head = torch.eye(20) * 1.0
    target = torch.full((2, 12, 20), -60.0).scatter(-1, ids, probs.log())
    kl = DistillKL(_Spec(3), DecayedCE(_Spec(3))).loss(target, head, labels, (ids, probs))
    assert abs(float(kl.loss_sum)) < 1e-5


def test_kl_needs_the_target_distribution():
    hidden, head, labels, _ = _case(2)
    with pytest.raises(RuntimeError, match="no target distribution"):
        DistillKL(_Spec(2), DecayedCE(_Spec(2))).loss(hidden, head, labels)
