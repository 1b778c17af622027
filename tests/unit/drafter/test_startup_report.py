"""The host-sync finder behind the drafter's "host syncs in one training step" line."""

import warnings

import pytest
import torch

from dflash_dist.drafter.startup_report import host_syncs, sync_warnings_recorded


def test_sync_warnings_are_recorded_with_their_location():
    with warnings.catch_warnings(record=True) as passed_on:
        warnings.simplefilter("always")
        with sync_warnings_recorded() as where:
            for _ in range(2):  # every sync, also a repeated one
                warnings.warn("called a synchronizing CUDA operation")  # what the sync debug mode raises
            warnings.warn("something else")                             # not a sync: shown as usual
    assert len(where) == 2 and where[0].startswith("test_startup_report.py:")
    assert [str(w.message) for w in passed_on] == ["something else"]


def test_sync_recording_keeps_other_warning_filters():
    """The compile guard turns flex's eager warning into an error with a filter; recording syncs must not undo it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="flex eager")
        with sync_warnings_recorded():
            with pytest.raises(UserWarning):
                warnings.warn("flex eager")


def test_host_syncs_on_cpu_runs_the_step_and_checks_nothing():
    out, syncs = host_syncs(lambda: torch.ones(2).sum(), "cpu")
    assert out.item() == 2.0 and syncs is None
