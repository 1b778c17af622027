"""model/head_shards: the frozen head's CE over vocabulary slices, combined, equals the whole head's (CE per row,
argmax, gradient wrt the rows), for uneven slices, any chunk height, and rows without a label."""

import pytest
import torch

from dflash_dist.model import loss as L
from dflash_dist.model.head_shards import ce_from_slices, serve_slice, slice_stats_columns, vocab_slice


def _case(rows=37, hidden=16, vocab=101, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    head = (torch.randn(vocab, hidden, generator=g) * 0.5).to(dtype)
    y = torch.randint(0, vocab, (rows,), generator=g)
    y[[3, 10, rows - 1]] = L.IGNORE_INDEX
    return x, head, y


def _sliced(x, head, y, parts, chunk):
    bounds = [vocab_slice(head.shape[0], parts, i) for i in range(parts)]
    return ce_from_slices([serve_slice(x, head[lo:hi], lo, y[:, None], chunk) for lo, hi in bounds], head, y)


@pytest.mark.parametrize("parts,chunk", [(1, 64), (2, 8), (3, 5), (4, 37), (7, 1)])
def test_slices_combine_to_the_whole_head(parts, chunk):
    x, head, y = _case()
    has = y != L.IGNORE_INDEX
    ce_ref, pred_ref, grad_ref = L.frozen_head_ce(x, head, y, has.float(), 16, False, per_row=True)
    ce, pred, grad = _sliced(x, head, y, parts, chunk)
    torch.testing.assert_close(ce, ce_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(pred, pred_ref)
    assert torch.equal(ce[~has], torch.zeros_like(ce[~has])) and not grad[~has].any()  # no loss, no gradient
    assert ce[has].min() > 0


def test_a_slice_reply_has_its_layout():
    x, head, y = _case()
    lo, hi = vocab_slice(head.shape[0], 3, 1)
    stats, best, g = serve_slice(x, head[lo:hi], lo, y[:, None], 8)
    assert stats.shape == (x.shape[0], slice_stats_columns(1)) == (x.shape[0], 3) and stats.dtype == torch.float32
    assert best.dtype == torch.int64 and ((best >= lo) & (best < hi)).all()  # global ids of this slice
    assert g.shape == x.shape and g.dtype == head.dtype
    inside = (y >= lo) & (y < hi)
    assert (stats[~inside, 2] == 0).all() and (stats[inside, 2] != 0).all()  # the label's logit: its slice only


def test_bf16_slices_stay_within_the_whole_heads_rounding():
    """bf16 rows and head (the served dtype on GPUs): the combined CE within bf16 rounding of the whole head's."""
    x, head, y = _case(rows=60, hidden=64, vocab=500, dtype=torch.bfloat16)
    has = y != L.IGNORE_INDEX
    ce_ref, _, grad_ref = L.frozen_head_ce(x, head, y, has.float(), 16, False, per_row=True)
    ce, _, grad = _sliced(x, head, y, 2, 16)
    torch.testing.assert_close(ce, ce_ref, rtol=2e-2, atol=2e-2)
    assert (grad - grad_ref.float()).norm() / grad_ref.float().norm() < 1e-2
