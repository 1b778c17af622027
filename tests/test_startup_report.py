"""The host-sync finder behind the drafter's "host syncs in one training step" line."""

import warnings

import torch

from dflash_dist.startup_report import host_syncs, sync_warnings_recorded


def test_sync_warnings_are_recorded_with_their_location():
    with sync_warnings_recorded() as where:
        warnings.warn("called a synchronizing CUDA operation")  # what the sync debug mode raises
        warnings.warn("something else")                         # other warnings are not syncs
    assert len(where) == 1 and where[0].startswith("test_startup_report.py:")


def test_host_syncs_on_cpu_runs_the_step_and_checks_nothing():
    out, syncs = host_syncs(lambda: torch.ones(2).sum(), "cpu")
    assert out.item() == 2.0 and syncs is None
