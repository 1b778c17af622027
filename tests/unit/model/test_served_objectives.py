"""model/objectives: each objective's loss served on a target (``rows`` / ``request_inputs`` / ``serve`` / ``parts``,
what drafter.tuning.loss_on_target runs) equals its loss on the drafter: loss sum, weight sum, statistics and the
gradient wrt the drafter's hidden rows, on random inputs."""

import pytest
import torch
from test_spec import TARGET

from dflash_dist.comm.head_offload import _ReceivedGrad
from dflash_dist.config import ConfigError, DrafterConfig
from dflash_dist.model import loss as L
from dflash_dist.model.objectives.distill import kl_rows
from dflash_dist.model.spec import resolve_drafter

V, H, BSZ = 64, 32, 4


def _objective(**loss):
    dc = DrafterConfig(num_layers=2, block_size=BSZ, loss=loss, tuning={"loss_chunk_rows": 16})
    return resolve_drafter(dc, TARGET, 3, "cpu").make_objective()


def _case(k=5, b=2, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, n * BSZ, H, generator=g, requires_grad=True)
    head = torch.randn(V, H, generator=g) * 0.5
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(b * n * BSZ)]).view(b, n * BSZ, k)
    probs = torch.softmax(torch.randn(b, n * BSZ, k, generator=g), -1)
    labels = ids[..., 0].clone()
    labels[0, 5:9] = L.IGNORE_INDEX                    # unsupervised slots, one inside a block
    labels[1, -3:] = L.IGNORE_INDEX
    labels[:, ::BSZ] = L.IGNORE_INDEX                  # slot 0 never carries a loss
    return hidden, head, labels, (ids, probs)


def _served(obj, hidden, head, labels, soft):
    """The drafter's and the target's halves of a served group, no process group: what HeadLossClient sends and
    HeadLossServer computes, tied to the rows as the client ties the reply."""
    rows, rows_y, rows_w = obj.rows(hidden, labels)
    inputs = obj.request_inputs(labels, soft)
    assert [(t.shape[1], t.dtype) for t in inputs] == list(obj.request_specs())
    loss_sum, pred, grad, extra = obj.serve(rows.detach().clone(), head, rows_y.clone(), *(t.clone() for t in inputs))
    assert (extra is None) == (obj.reply_columns == 0)
    if extra is not None:
        assert extra.shape == (rows_y.numel(), obj.reply_columns) and extra.dtype == torch.float32
    return obj.parts(_ReceivedGrad.apply(rows, grad) + loss_sum.float(), pred, rows_y, rows_w, extra)


@pytest.mark.parametrize("loss", [{"weighting": "dpace"}, {"weighting": "dpace", "dpace_alpha": 0.2},
                                  {"labels": "target", "kind": "kl", "kl_top_k": 5},
                                  {"labels": "target", "kind": "kl", "kl_top_k": 1}, {}])
def test_served_loss_equals_the_drafters(loss):
    obj = _objective(**loss)
    hidden, head, labels, soft = _case(k=obj.spec.loss.kl_top_k if loss.get("kind") == "kl" else 5)
    soft_arg = (soft,) if loss.get("kind") == "kl" else ()
    local = obj.loss(hidden, head, labels, *soft_arg)
    (0.37 * local.loss_sum).backward()
    g_local, hidden.grad = hidden.grad.clone(), None
    served = _served(obj, hidden, head, labels, soft)
    (0.37 * served.loss_sum).backward()
    torch.testing.assert_close(served.loss_sum, local.loss_sum.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(served.weight_sum, local.weight_sum)  # the step's normaliser: bit for bit
    torch.testing.assert_close(hidden.grad, g_local, rtol=1e-5, atol=1e-6)
    assert hidden.grad.abs().sum() > 0
    assert torch.equal(served.slot_correct, local.slot_correct) and torch.equal(served.slot_count, local.slot_count)
    assert served.stats.keys() == local.stats.keys() == obj.stats(local).keys() - {"loss_sum", "weight_sum",
                                                                                     "slot_correct", "slot_count"}
    for name in served.stats:
        torch.testing.assert_close(served.stats[name], local.stats[name], rtol=1e-5, atol=1e-6)


def test_dpace_weights_come_with_the_reply():
    """D-PACE's weights depend on the CE computed on the target: the served weight sum is the reply's (not the
    slot weights ``rows`` gives), and the drafter must take the reply before the step's weight sum."""
    obj = _objective(weighting="dpace")
    assert obj.weights_served and obj.reply_columns == 2 and not _objective().weights_served
    hidden, head, labels, soft = _case()
    served = _served(obj, hidden, head, labels, soft)
    _, _, slot_w = obj.rows(hidden, labels)
    assert not torch.allclose(served.weight_sum, slot_w.sum())
    assert torch.allclose(served.weight_sum, obj.loss(hidden, head, labels).weight_sum)


def test_fused_kl_equals_the_checkpointed_chunks_and_never_recomputes_logits():
    """kind=kl's training path (gradient in forward, the target's function) against the checkpointed chunks."""
    obj = _objective(labels="target", kind="kl", kl_top_k=5)
    hidden, head, labels, soft = _case()
    rows, rows_y, rows_w = obj.rows(hidden, labels)
    ids, probs = obj.request_inputs(labels, soft)
    ref, ref_pred = kl_rows(rows, head, ids, probs, rows_w, 16)
    (g_ref,) = torch.autograd.grad(ref, hidden)
    calls = []
    orig = torch.Tensor.__matmul__

    def counting(a, b):
        if b.shape[-1] == V:
            calls.append(a.shape[0])
        return orig(a, b)

    torch.Tensor.__matmul__ = counting
    try:
        parts = obj.loss(hidden, head, labels, soft)
        fwd = len(calls)
        (g,) = torch.autograd.grad(parts.loss_sum, hidden)
    finally:
        torch.Tensor.__matmul__ = orig
    assert fwd > 1 and max(calls) <= 16 and len(calls) == fwd  # chunked forward, nothing recomputed in backward
    torch.testing.assert_close(parts.loss_sum, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(parts.slot_correct, L.slot_stats(ref, ref_pred, rows_y, rows_w, BSZ).slot_correct)


def test_kl_with_dpace_weights_is_refused():
    with pytest.raises(ConfigError, match="drafter.loss.weighting=decay"):
        _objective(labels="target", kind="kl", weighting="dpace")


def test_compiled_kl_chunks_equal_the_eager_ones(monkeypatch):
    """drafter.tuning.compile_loss (the default with flex): the KL's chunk math through torch.compile gives the
    eager numbers; the eager function must not be what runs."""
    from dflash_dist.model.objectives import distill
    hidden, head, labels, soft = _case()
    obj = _objective(labels="target", kind="kl", kl_top_k=5)
    rows, rows_y, rows_w = obj.rows(hidden.detach(), labels)
    ids, probs = obj.request_inputs(labels, soft)
    want = distill.frozen_head_kl(rows, head, ids, probs, rows_w, 16, compiled=False)
    monkeypatch.setattr(distill, "_kl_and_logit_grad", _must_not_run)  # the compiled wrapper holds the original
    got = distill.frozen_head_kl(rows, head, ids, probs, rows_w, 16, compiled=True)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)


def _must_not_run(*args):
    raise AssertionError("the eager chunk function ran although compiled=True")


def _served_in_slices(obj, hidden, head, labels, slices, soft=None):
    """A replica's ranks each serve their slice of the vocabulary; the drafter combines the replies."""
    from dflash_dist.model.head_shards import vocab_slice
    rows, rows_y, rows_w = obj.rows(hidden, labels)
    inputs = obj.request_inputs(labels, soft)
    replies = [obj.serve_slice(rows.detach().clone(), head[lo:hi], lo, rows_y.clone(), *inputs)
               for lo, hi in (vocab_slice(V, slices, i) for i in range(slices))]
    assert all(r[0].shape == (rows_y.numel(), obj.slice_stats_columns) for r in replies)
    loss_sum, pred, grad, extra = obj.combine_slices(replies, head, rows_y, *inputs)
    assert (extra is None) == (obj.reply_columns == 0) and grad.shape == rows.shape
    return obj.parts(_ReceivedGrad.apply(rows, grad) + loss_sum.float(), pred, rows_y, rows_w, extra)


@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("loss", [{}, {"weighting": "dpace"}, {"labels": "target", "kind": "kl", "kl_top_k": 5},
                                  {"labels": "target", "kind": "kl", "kl_top_k": 1}])
def test_loss_served_in_vocabulary_slices_equals_the_drafters(loss, slices):
    """drafter.tuning.loss_on_target on a replica: each rank's slice of the head, combined on the drafter, gives
    the drafter's own loss, statistics and gradient (fp32, to rounding); the argmax is the whole head's, and
    where slices tie, the lowest id (as argmax over the whole vocabulary picks)."""
    obj = _objective(**loss)
    assert obj.vocab_parallel
    hidden, head, labels, soft = _case(k=obj.spec.loss.kl_top_k if loss.get("kind") == "kl" else 5)
    soft_arg = (soft,) if loss.get("kind") == "kl" else ()
    local = obj.loss(hidden, head, labels, *soft_arg)
    (0.37 * local.loss_sum).backward()
    g_local, hidden.grad = hidden.grad.clone(), None
    served = _served_in_slices(obj, hidden, head, labels, slices, soft)
    (0.37 * served.loss_sum).backward()
    torch.testing.assert_close(served.loss_sum, local.loss_sum.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(served.weight_sum, local.weight_sum, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden.grad, g_local, rtol=1e-5, atol=1e-6)
    assert torch.equal(served.slot_correct, local.slot_correct) and torch.equal(served.slot_count, local.slot_count)
    for name in served.stats:
        torch.testing.assert_close(served.stats[name], local.stats[name], rtol=1e-5, atol=1e-6)
    rows, rows_y, _ = obj.rows(hidden.detach(), labels)
    whole = (rows @ head.t()).argmax(-1)
    from dflash_dist.model.head_shards import combine_slices, serve_slice, vocab_slice
    def pred(w):
        return combine_slices([serve_slice(rows, w[lo:hi], lo, rows_y[:, None], 16)
                               for lo, hi in (vocab_slice(V, slices, i) for i in range(slices))])[2]
    assert torch.equal(pred(head), whole)
    assert torch.equal(pred(torch.zeros_like(head)), torch.zeros_like(whole))  # every entry ties: id 0


def test_every_built_in_objective_has_the_slice_math():
    """On a replica every rank serves its slice for the built-in objectives (an objective of one's own without it
    is served whole by the feeder: tests/integration/test_replicas.py)."""
    for loss in ({}, {"weighting": "dpace"}, {"labels": "target", "kind": "kl", "kl_top_k": 5}):
        assert _objective(**loss).vocab_parallel


def test_vocabulary_slices_cover_it_in_order():
    from dflash_dist.model.head_shards import vocab_slice
    for vocab, parts in ((64, 2), (151936, 3), (7, 4), (5, 5)):
        s = [vocab_slice(vocab, parts, i) for i in range(parts)]
        assert s[0][0] == 0 and s[-1][1] == vocab and all(a[1] == b[0] for a, b in zip(s, s[1:]))
        assert max(hi - lo for lo, hi in s) - min(hi - lo for lo, hi in s) <= 1
