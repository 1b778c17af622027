"""drafter/trainer: when training stops as diverged (TrainingDiverged, exit code 3)."""

from types import SimpleNamespace

import pytest
import torch

from dflash_dist.config import ConfigError, TrainConfig
from dflash_dist.roles.drafter_rank.trainer import DrafterTrainer, TrainingDiverged


def _trainer(run: int, since: int = 5, limit: int = 3):
    """What check_finite reads of a trainer: the device counters, the setting, the checkpoints."""
    return SimpleNamespace(nonfinite_run=torch.tensor(run), nonfinite_since=torch.tensor(since),
                           cfg=SimpleNamespace(train=TrainConfig(max_nonfinite_steps=limit)), last_checkpoint="ck",
                           job=SimpleNamespace(resume_from=None), step=9)


def test_nonfinite_steps_stop_after_the_limit_and_before_any_save():
    DrafterTrainer.check_finite(_trainer(0))
    DrafterTrainer.check_finite(_trainer(0), saving=True)
    DrafterTrainer.check_finite(_trainer(2))                         # under the limit: the window goes on
    with pytest.raises(TrainingDiverged, match=r"at step 5: .* 3 step\(s\) in a row, through step 7 "
                                               r"\(train.max_nonfinite_steps=3\).*newest: ck"):
        DrafterTrainer.check_finite(_trainer(3))
    with pytest.raises(TrainingDiverged, match="at step 5: .*a checkpoint now would hold them"):
        DrafterTrainer.check_finite(_trainer(1), saving=True)       # no checkpoint of non-finite weights
    with pytest.raises(ConfigError, match="max_nonfinite_steps"):
        TrainConfig(max_nonfinite_steps=0)


def test_a_launch_that_trained_nothing_is_not_a_finished_run():
    DrafterTrainer.check_trained(_trainer(0), {"received": 10, "skipped": 3})
    DrafterTrainer.check_trained(_trainer(0), {"received": 0, "skipped": 0})   # nothing came: nothing to train
    with pytest.raises(TrainingDiverged, match="step 9: this launch trained none of the 10 samples"):
        DrafterTrainer.check_trained(_trainer(0), {"received": 10, "skipped": 10})


def test_a_variants_terms_get_the_weights_the_objectives_loss_used():
    """D-PACE's row weights depend on the loss: a variant's term (Domino, DFlash2) is weighted like the group's
    own loss, not by the objective's slot weights; a group served on a target (no LossParts yet) gets those."""
    from dflash_dist.model.loss import LossParts
    slot_w = torch.tensor([0.5, 0.25])
    objective = SimpleNamespace(rows=lambda hidden, labels: (hidden, labels, slot_w))
    fake = SimpleNamespace(objective=objective, _loss_term_names=lambda: ["domino"])
    used = torch.tensor([2.0, 0.0])
    parts = LossParts(loss_sum=torch.zeros(()), weight_sum=used.sum(), slot_correct=torch.zeros(2),
                      slot_count=torch.zeros(2), row_weights=used)
    hidden, labels = torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)
    assert torch.equal(DrafterTrainer._row_weights(fake, hidden, labels, parts), used)
    assert torch.equal(DrafterTrainer._row_weights(fake, hidden, labels, object()), slot_w)   # a served request
    none = SimpleNamespace(objective=objective, _loss_term_names=lambda: [])
    assert DrafterTrainer._row_weights(none, hidden, labels, parts) is None
