"""model/objectives: decayed_ce as the loss functions compute it, the paper's gamma, a toy objective."""

import pytest
import torch
from helpers.toy_seams import UniformCE
from test_spec import TARGET

from dflash_dist.config import DrafterConfig
from dflash_dist.model.loss import decayed_ce, loss_rows, row_weights
from dflash_dist.model.objectives import DecayedCE, objective_class, paper_gamma
from dflash_dist.model.spec import resolve_drafter


def _spec(**kw):
    return resolve_drafter(DrafterConfig(num_layers=2, **kw), TARGET, 3, "cpu")


def test_gamma_per_paper_and_rule_for_other_block_sizes():
    # the DFlash paper: gamma 7, 5, 4 for block sizes 16, 10, 8
    assert [DecayedCE(_spec(block_size=b)).gamma for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    # other B: this project's piecewise-linear rule through the paper's points (not from the paper)
    assert paper_gamma(12) == pytest.approx(5 + 2 / 3) and paper_gamma(9) == pytest.approx(4.5)
    assert paper_gamma(4) == 2.0 and paper_gamma(2) == 1.0 and paper_gamma(32) == pytest.approx(7 + 16 / 3)
    gammas = [paper_gamma(b) for b in range(2, 65)]
    assert all(a < b for a, b in zip(gammas, gammas[1:]))  # longer blocks never decay faster
    assert DecayedCE(_spec(block_size=10, loss={"gamma": 3.5})).gamma == 3.5  # an explicit value wins


def test_decayed_ce_objective_is_the_loss_functions_bit_for_bit():
    """The trainer's local loss and a served request's: the same numbers and gradient as the functions the job
    called before objectives were objects."""
    obj = objective_class("decayed_ce")(_spec(block_size=4, loss={"gamma": 3.0}, tuning={"loss_chunk_rows": 16}))
    torch.manual_seed(0)
    head = torch.randn(50, 32)
    labels = torch.randint(0, 50, (2, 24))
    labels[0, :5] = -100
    hidden = torch.randn(2, 24, 32, requires_grad=True)
    ref = decayed_ce(hidden, head, labels, 4, 3.0, 16)
    ref.loss_sum.backward()
    g_ref, hidden.grad = hidden.grad.clone(), None
    got = obj.loss(hidden, head, labels)
    got.loss_sum.backward()
    assert torch.equal(got.loss_sum, ref.loss_sum) and torch.equal(hidden.grad, g_ref)
    assert torch.equal(got.slot_correct, ref.slot_correct) and torch.equal(got.weight_sum, ref.weight_sum)
    rows, rows_y, rows_w = obj.rows(hidden, labels)
    want = loss_rows(hidden, labels, 4, 3.0)
    assert torch.equal(rows, want[0]) and torch.equal(rows_w, want[2])
    assert torch.equal(rows_w, row_weights(rows_y, 4, 3.0))
    loss_sum, pred, grad, extra = obj.serve(rows.detach(), head, rows_y)
    assert torch.equal(loss_sum, ref.loss_sum.detach()) and extra is None and obj.reply_columns == 0
    parts = obj.parts(loss_sum, pred, rows_y, rows_w)
    m = obj.window_metrics({k: (v.reshape(-1).double().tolist()) for k, v in obj.stats(parts).items()})
    assert m["loss"] == pytest.approx(float(ref.loss_sum.detach() / ref.weight_sum))
    assert 0 <= m["acc"] <= 1 and 1 <= m["tau_from_acc"] <= 4 and set(m) >= {"acc_slot_1", "acc_slot_3"}


def test_toy_objective_weights_every_slot_alike():
    obj = UniformCE(_spec(block_size=4))
    assert obj.slot_weights().tolist() == [0.0, 1.0, 1.0, 1.0]
    labels = torch.randint(0, 50, (1, 8))
    labels[0, 5] = -100
    _, rows_y, rows_w = obj.rows(torch.randn(1, 8, 32), labels)
    # slots 1..3 of 2 blocks; position 5 (block 1, slot 1) has no label: weight 0
    assert rows_w.tolist() == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0]
