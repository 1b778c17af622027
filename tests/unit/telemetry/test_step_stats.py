"""telemetry/step_stats.py: named slots of one accumulated tensor."""

import pytest
import torch

from dflash_dist.telemetry.step_stats import StepStats


def test_slots_add_by_name_and_read_resets():
    s = StepStats({"loss_sum": 1, "slot_count": 3, "steps": 1}, "cpu")
    assert s.buf.shape == (5,) and s.buf.dtype == torch.float64
    s.add("loss_sum", torch.tensor(1.5))
    s.add("slot_count", torch.tensor([0, 2, 3]))
    s.add_all({"steps": 1.0, "loss_sum": torch.tensor([0.5], dtype=torch.float32)})
    s.add("slot_count", torch.tensor([0, 1, 1]))
    assert s.read(reduce=False) == {"loss_sum": [2.0], "slot_count": [0.0, 3.0, 4.0], "steps": [1.0]}
    assert s.read(reduce=False) == {"loss_sum": [0.0], "slot_count": [0.0, 0.0, 0.0], "steps": [0.0]}


def test_wrong_sizes_and_names_refused():
    with pytest.raises(ValueError, match="size 0"):
        StepStats({"x": 0}, "cpu")
    s = StepStats({"x": 2}, "cpu")
    with pytest.raises(KeyError):
        s.add("y", 1.0)
    with pytest.raises(RuntimeError):
        s.add("x", torch.ones(3))
