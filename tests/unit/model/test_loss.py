"""Slot weights and the chunked decayed cross-entropy."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import dflash_dist.model.loss as loss_mod
from dflash_dist.model.loss import _chunks, decayed_ce, slot_weights

B, N, BS, H, V = 2, 3, 8, 16, 37  # H != chunk sizes, so [H, V] (weight.t()) is never taken for logits


def test_slot_weights_b16_gamma7():
    w = slot_weights(16, 7.0)
    assert w.shape == (16,) and w.dtype == torch.float32
    assert w[0] == 0 and w[1] == 1
    assert math.isclose(float(w[2]), math.exp(-1 / 7), rel_tol=1e-6)
    expect = [0.0] + [math.exp(-(k - 1) / 7) for k in range(1, 16)]
    assert torch.allclose(w, torch.tensor(expect), rtol=1e-6, atol=0)


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, N * BS, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (B, N * BS), generator=g)
    labels[torch.rand(B, N * BS, generator=g) < 0.3] = -100
    labels[1, 2 * BS:] = -100                 # a padding block
    return hidden, weight, labels


def _reference(hidden, weight, labels, gamma):
    """Unchunked: full logits, F.cross_entropy with per-row weights (slot 0 labels ignored)."""
    logits = (hidden @ weight.t()).float()
    slot = torch.arange(N * BS) % BS
    lab = labels.masked_fill(slot == 0, -100)
    ce = F.cross_entropy(logits.reshape(-1, V), lab.reshape(-1), ignore_index=-100, reduction="none")
    w = slot_weights(BS, gamma)[slot].expand_as(lab) * (lab != -100)
    ok = (logits.argmax(-1) == lab) & (lab != -100)
    correct = torch.zeros(BS, dtype=torch.long).index_add_(0, slot, ok.long().sum(0))
    count = torch.zeros(BS, dtype=torch.long).index_add_(0, slot, (lab != -100).long().sum(0))
    return (ce * w.reshape(-1)).sum(), w.sum(), correct, count


@pytest.mark.parametrize("chunk", [5, 16, 1000])
def test_decayed_ce_matches_unchunked_reference(chunk):
    gamma = 3.0
    hidden, weight, labels = _data()
    ref_sum, ref_w, ref_correct, ref_count = _reference(hidden, weight, labels, gamma)
    (ref_sum / ref_w).backward()
    ref_gh, ref_gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    parts = decayed_ce(hidden, weight, labels, BS, gamma, chunk)
    torch.testing.assert_close(parts.loss_sum, ref_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts.weight_sum, ref_w, rtol=1e-6, atol=1e-6)
    assert parts.loss_sum.requires_grad and not parts.weight_sum.requires_grad
    assert parts.slot_correct.shape == parts.slot_count.shape == (BS,)
    assert torch.equal(parts.slot_correct, ref_correct) and torch.equal(parts.slot_count, ref_count)
    assert parts.slot_count[0] == 0
    parts.loss().backward()
    torch.testing.assert_close(hidden.grad, ref_gh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_gw, rtol=1e-5, atol=1e-6)


def test_slot_accuracy_counts_exact():
    # one sample, one block of 4: hidden rows are one-hot directions, weight = identity -> argmax = row's class
    weight = torch.eye(6)
    hidden = torch.zeros(1, 4, 6)
    for slot, cls in enumerate([0, 2, 3, 5]):
        hidden[0, slot, cls] = 5.0
    labels = torch.tensor([[0, 2, 4, -100]])    # slot 0 ignored; slot 1 right; slot 2 wrong; slot 3 unlabeled
    parts = decayed_ce(hidden, weight, labels, 4, 7.0, 16)
    assert parts.slot_correct.tolist() == [0, 1, 0, 0]
    assert parts.slot_count.tolist() == [0, 1, 1, 0]
    assert math.isclose(float(parts.weight_sum), 1 + math.exp(-1 / 7), rel_tol=1e-6)


class _VocabShapes(TorchDispatchMode):
    """Records the row count of every op output whose last dim is the vocab size."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] == V and t.shape[0] not in (V, H):
                self.rows.append(t.shape[0])
        return out


def test_logits_are_chunked_in_forward_and_backward_and_not_saved():
    hidden, weight, labels = _data()
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with _VocabShapes() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        parts = decayed_ce(hidden, weight, labels, BS, 7.0, 5)
    n_fwd = len(mode.rows)
    with _VocabShapes() as mode_bwd:
        parts.loss_sum.backward()
    assert n_fwd > 0 and max(mode.rows) <= 5
    assert len(mode_bwd.rows) > 0 and max(mode_bwd.rows) <= 5     # recomputed chunk by chunk
    # checkpoint: autograd keeps only chunk inputs, never a [rows, V] logits tensor
    assert not any(len(s) == 2 and s[-1] == V and s[0] not in (V, H) for s in saved), saved


def test_no_grad_path_and_all_ignored():
    hidden, weight, labels = _data()
    with torch.no_grad():
        parts = decayed_ce(hidden, weight, torch.full_like(labels, -100), BS, 7.0, 16)
    assert parts.loss_sum == 0 and parts.weight_sum == 0 and parts.slot_count.sum() == 0
    assert parts.loss() == 0


@pytest.mark.parametrize("chunk,compiled", [(5, False), (16, False), (1000, False), (5, True), (16, True)])
def test_fused_frozen_head_matches_reference(chunk, compiled, monkeypatch):
    """The training path (frozen lm_head): loss, accuracy and hidden-state gradient equal the unchunked
    reference; the head gets no gradient."""
    gamma = 3.0
    hidden, weight, labels = _data()
    weight.requires_grad_(False)
    ref_sum, ref_w, ref_correct, ref_count = _reference(hidden, weight, labels, gamma)
    (ref_sum / ref_w).backward()
    ref_gh = hidden.grad.clone()
    hidden.grad = None
    if compiled:  # the compiled chunk function must be what runs
        monkeypatch.setattr(loss_mod, "_ce_and_logit_grad_eager", _must_not_run)
    parts = decayed_ce(hidden, weight, labels, BS, gamma, chunk, compiled=compiled)       # auto -> fused
    torch.testing.assert_close(parts.loss_sum, ref_sum, rtol=1e-5, atol=1e-5)
    assert torch.equal(parts.slot_correct, ref_correct) and torch.equal(parts.slot_count, ref_count)
    parts.loss().backward()
    torch.testing.assert_close(hidden.grad, ref_gh, rtol=1e-5, atol=1e-6)
    assert weight.grad is None


def test_fused_loss_never_recomputes_logits_in_backward():
    hidden, weight, labels = _data()
    weight.requires_grad_(False)
    with _VocabShapes() as fwd:
        parts = decayed_ce(hidden, weight, labels, BS, 7.0, 5, mode="fused")
    with _VocabShapes() as bwd:
        parts.loss_sum.backward()
    assert fwd.rows and max(fwd.rows) <= 5          # chunked in forward
    assert bwd.rows == []                           # backward only scales the stored [rows, H] gradient
    ckpt = decayed_ce(hidden.detach().requires_grad_(), weight, labels, BS, 7.0, 5, mode="checkpoint")
    with _VocabShapes() as bwd_ckpt:
        ckpt.loss_sum.backward()
    assert bwd_ckpt.rows                            # the checkpointed path recomputes them


def test_fused_loss_refuses_a_trainable_head():
    hidden, weight, labels = _data()
    with pytest.raises(ValueError, match="frozen lm_head"):
        decayed_ce(hidden, weight, labels, BS, 7.0, 5, mode="fused")


def _must_not_run(*args):
    raise AssertionError("the eager chunk function ran although compiled=True")


def test_chunks_never_leave_a_single_row():
    """A 1-row chunk would make the dynamic-shape compiled loss specialise (one more compile mid-training)."""
    assert _chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert _chunks(9, 4) == [(0, 4), (4, 9)]
    assert _chunks(3, 4) == [(0, 3)]
    for rows in range(2, 40):
        for size in range(2, 12):
            parts = _chunks(rows, size)
            assert parts[0][0] == 0 and parts[-1][1] == rows
            assert all(hi - lo >= 2 and hi - lo <= size + 1 for lo, hi in parts)
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))


@pytest.mark.parametrize("vocab", [151936, 1000, 2049, 129])
def test_grouped_topk_is_topk(vocab):
    """Two small passes (group maxima, then the top groups' entries) give topk's ids, best first; on bf16 logits
    (ties possible) the same values."""
    g = torch.Generator().manual_seed(vocab)
    for k in (1, 4, 16):
        x = torch.randn(9, vocab, generator=g)
        assert torch.equal(loss_mod.grouped_topk(x, k), x.topk(k, dim=-1).indices)
        xb = x.bfloat16()
        assert torch.equal(xb.gather(-1, loss_mod.grouped_topk(xb, k)), xb.topk(k, dim=-1).values)
    # the two-pass path itself ran (a vocabulary above k * group), not topk over the whole row
    seen = []
    real = torch.Tensor.topk
    try:
        torch.Tensor.topk = lambda self, *a, **kw: seen.append(self.shape[-1]) or real(self, *a, **kw)
        loss_mod.grouped_topk(torch.randn(3, 151936), 16)
    finally:
        torch.Tensor.topk = real
    assert 151936 not in seen and max(seen) <= 16 * loss_mod.TOPK_GROUP


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_pass_gives_topk_ids_of_its_logits(compiled, monkeypatch):
    """Eager and compiled (the top-K inside the compiled chunk graph), through grouped_topk's two passes
    (V > k * TOPK_GROUP): the ids of the chunk's own logits, the loss unchanged."""
    g = torch.Generator().manual_seed(5)
    B, V, H, k = 4, 1000, 16, 7
    assert k * loss_mod.TOPK_GROUP < V
    hidden = torch.randn(2, 3 * B, H, generator=g, requires_grad=True)
    head = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (2, 3 * B), generator=g)
    w = slot_weights(B, 4.0)
    if compiled:
        monkeypatch.setattr(loss_mod, "_ce_and_logit_grad_eager", _must_not_run)
    parts = loss_mod.weighted_ce(hidden, head, labels, w, chunk_rows=5, topk=k, compiled=compiled)
    rows_h = loss_mod.weighted_rows(hidden, labels, w)[0]
    assert torch.equal(parts.topk_ids, (rows_h.detach() @ head.t()).topk(k, dim=-1).indices)
    assert k in loss_mod._CE_GRAD_TOPK or not compiled
    plain = loss_mod.weighted_ce(hidden, head, labels, w, chunk_rows=5, compiled=compiled)
    assert plain.topk_ids is None
    torch.testing.assert_close(parts.loss_sum, plain.loss_sum, rtol=1e-6, atol=1e-5)
    assert loss_mod.weighted_ce(hidden, head, labels, w, chunk_rows=5, mode="checkpoint", topk=7).topk_ids is None
