"""model/objectives/dpace: D-PACE position weights, their fused chunked CE, speculators' reference, the config."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.ref_packages import install
from test_spec import TARGET

from dflash_dist.config import ConfigError, DrafterConfig
from dflash_dist.model.objectives import objective_class
from dflash_dist.model.objectives.dpace import dpace_ce, dpace_weights
from dflash_dist.model.spec import resolve_drafter

SPECULATORS = ["speculators==0.9.0", "hs-connectors", "openai", "jiter", "loguru"]


def _spec(**kw):
    return resolve_drafter(DrafterConfig(num_layers=2, **kw), TARGET, 3, "cpu")


def _ce_of(q):
    return -torch.log(torch.tensor(q, dtype=torch.float32))


def test_hand_vector():
    # q = [0.8, 0.5], alpha 0.5: q~ = [0.9, 0.75], C = [0.9, 0.675], w = [0.9 + 0.675, 0.675]
    w = dpace_weights(_ce_of([0.8, 0.5]), torch.tensor([True, True]), 3, 0.5)
    assert w.tolist() == pytest.approx([1.575, 0.675], abs=1e-6)


def test_masking_a_slot_equals_dropping_it():
    q = [0.8, 0.3, 0.6, 0.9]
    w = dpace_weights(_ce_of(q), torch.tensor([True, False, True, True]), 5, 0.4)
    dropped = dpace_weights(_ce_of([0.8, 0.6, 0.9, 0.5]), torch.tensor([True, True, True, False]), 5, 0.4)
    assert w[1] == 0.0
    assert w[[0, 2, 3]].tolist() == pytest.approx(dropped[:3].tolist(), abs=1e-7)


def test_weights_equal_speculators_dpace_loss_decay():
    install("speculators-0.9.0", SPECULATORS)
    from speculators.losses.utils import dpace_loss_decay
    torch.manual_seed(0)
    B, n = 6, 7
    ce = torch.rand(n, B) * 3
    mask = torch.rand(n, B) > 0.3
    mask[:, 0] = False                                            # the anchor slot: never supervised
    for alpha in (0.5, 0.2, 1.0):
        ref = dpace_loss_decay(None, mask.reshape(1, -1), B, alpha, ce.reshape(1, -1)).reshape(n, B)
        got = dpace_weights(ce[:, 1:].reshape(-1), mask[:, 1:].reshape(-1), B, alpha).reshape(n, B - 1)
        assert ref[:, 0].abs().max() == 0
        torch.testing.assert_close(got, ref[:, 1:], rtol=1e-6, atol=1e-6)


def _by_hand(hidden, head, labels, B, alpha):
    """sum_j w_j CE_j with the weights from the detached CE, from full logits (the test's reference)."""
    logits = (hidden @ head.t()).float().reshape(-1, head.shape[0])
    ce = F.cross_entropy(logits, labels.reshape(-1).clamp_min(0), reduction="none").reshape(-1, B)
    has = (labels != -100).reshape(-1, B)
    w = dpace_weights(ce[:, 1:].reshape(-1), has[:, 1:].reshape(-1), B, alpha).reshape(-1, B - 1)
    return (w * ce[:, 1:]).sum(), w.sum()


@pytest.mark.parametrize("chunk_rows", [5, 64])
def test_fused_chunked_loss_and_gradient_equal_full_logits(chunk_rows):
    torch.manual_seed(1)
    B = 4
    head = torch.randn(40, 16)
    labels = torch.randint(0, 40, (2, 6 * B))
    labels[0, :7] = -100
    hidden = torch.randn(2, 6 * B, 16, requires_grad=True)
    ref_sum, ref_w = _by_hand(hidden, head, labels, B, 0.5)
    ref_sum.backward()
    g_ref, hidden.grad = hidden.grad.clone(), None
    got = dpace_ce(hidden, head, labels, B, 0.5, chunk_rows)
    got.loss_sum.backward()
    torch.testing.assert_close(got.loss_sum, ref_sum.detach())
    torch.testing.assert_close(got.weight_sum, ref_w)
    torch.testing.assert_close(hidden.grad, g_ref)
    assert got.stats["dpace_weight"].sum() == pytest.approx(float(ref_w), rel=1e-5)
    assert got.row_weights is not None and got.row_weights.sum() == pytest.approx(float(ref_w), rel=1e-5)
    with torch.no_grad():                                          # the unfused path (evaluation): same sums
        plain = dpace_ce(hidden, head, labels, B, 0.5, chunk_rows)
    torch.testing.assert_close(plain.loss_sum, ref_sum.detach())


def test_objective_weighting_key_and_metrics():
    dec = objective_class("decayed_ce")(_spec(block_size=4))
    dp = objective_class("decayed_ce")(_spec(block_size=4, loss={"weighting": "dpace", "dpace_alpha": 0.25}))
    torch.manual_seed(2)
    head, labels = torch.randn(30, 8), torch.randint(0, 30, (1, 12))
    hidden = torch.randn(1, 12, 8, requires_grad=True)
    a, b = dec.loss(hidden, head, labels), dp.loss(hidden, head, labels)
    assert not torch.allclose(a.loss_sum, b.loss_sum)
    ref, _ = _by_hand(hidden, head, labels, 4, 0.25)
    torch.testing.assert_close(b.loss_sum, ref)
    assert "dpace_q" in dp.stat_slots() and "dpace_q" not in dec.stat_slots()
    m = dp.window_metrics({k: v.reshape(-1).double().tolist() for k, v in dp.stats(b).items()})
    q = torch.exp(-F.cross_entropy(hidden.detach()[0] @ head.t(), labels[0], reduction="none")).reshape(3, 4)
    assert m["dpace_q"] == pytest.approx(float(q[:, 1:].mean()), rel=1e-5)
    w = dpace_weights(-torch.log(q[:, 1:]).reshape(-1), torch.ones(9, dtype=torch.bool), 4, 0.25).reshape(3, 3)
    assert [m[f"dpace_weight_slot_{k}"] for k in (1, 2, 3)] == pytest.approx(w.mean(0).tolist(), rel=1e-5)
    assert 0 < m["dpace_weight_slot_3"] < m["dpace_weight_slot_1"]
    assert "D-PACE" in dp.describe()


def test_config_refuses_bad_settings():
    with pytest.raises(ConfigError, match="drafter.loss.weighting"):
        DrafterConfig(loss={"weighting": "uniform"})
    with pytest.raises(ConfigError, match="drafter.loss.dpace_alpha"):
        DrafterConfig(loss={"weighting": "dpace", "dpace_alpha": 0.0})
    # served on the target too (tests/unit/model/test_served_objectives.py)
    assert DrafterConfig(loss={"weighting": "dpace"}, tuning={"loss_on_target": True}).tuning.loss_on_target
    assert math.isclose(DrafterConfig().loss.dpace_alpha, 0.5) and DrafterConfig().loss.weighting == "decay"
