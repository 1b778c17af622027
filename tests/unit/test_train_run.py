"""dflash_dist.train's end of a rank without torchrun: how a rank whose wait on a peer broke reports the stop."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

import dflash_dist.roles.drafter_rank.loop as drafter_loop
from dflash_dist import train
from dflash_dist.comm.lifecycle import STOPPED_AT_ONCE


class _Life:
    """A Lifecycle whose peer (the target) posts its second-signal stop only after this rank's wait broke."""
    def __init__(self, store, rank, role, world_size, role_of):
        self.rank, self.role, self.stop_now, self.posted = rank, role, False, None

    def failure(self):
        return None  # not posted yet when the exception reaches train.run

    def root_cause(self, settle_s):
        return f"rank 1 (target) {STOPPED_AT_ONCE}"  # posted while root_cause settles

    def report_failure(self, text):
        self.posted = self.posted or text


def _exit(code):
    raise SystemExit(code)


@pytest.fixture
def drafter_rank(monkeypatch):
    topo = SimpleNamespace(role="drafter", rank=0, world_size=2, role_of=None)
    job = SimpleNamespace(nothing_left=None, run_dir="unused", dist=SimpleNamespace(topo=topo, store=None))
    monkeypatch.setattr(train, "setup", lambda cfg: job)
    monkeypatch.setattr(train, "tell_launcher", lambda run_dir: None)
    monkeypatch.setattr(train, "role_view", lambda job, role: job)
    monkeypatch.setattr(train, "Lifecycle", _Life)
    monkeypatch.setattr(train.os, "_exit", _exit)
    monkeypatch.setattr(train, "release_claims", lambda: None)
    return SimpleNamespace(logging=SimpleNamespace(debug=SimpleNamespace(profile_step=0)))


def test_a_peers_second_signal_posted_after_the_wait_broke_stops_at_once(drafter_rank, monkeypatch, caplog):
    """The peer's 'stopped at once' reaches the store after this rank's broken wait was caught: rank 0 still says
    once that no checkpoint was written and exits 130 (not 1, with the peer's stop as an error)."""
    def broken_wait(job):
        raise RuntimeError("Connection closed by peer")
    monkeypatch.setattr(drafter_loop, "run_drafter", broken_wait)
    with caplog.at_level(logging.WARNING, logger="dflash_dist"), pytest.raises(SystemExit) as ei:
        train.run(drafter_rank)
    assert ei.value.code == 130
    assert caplog.text.count(f"{STOPPED_AT_ONCE}: no checkpoint written") == 1
    assert "stopping without a checkpoint because" not in caplog.text


def test_a_peers_failure_is_reported_once_as_the_root_cause(drafter_rank, monkeypatch, caplog):
    """The control: a peer that failed (not a second signal) is named as the cause and this rank exits 1."""
    def broken_wait(job):
        raise RuntimeError("Connection closed by peer")
    monkeypatch.setattr(drafter_loop, "run_drafter", broken_wait)
    monkeypatch.setattr(_Life, "root_cause", lambda self, settle_s: "rank 1 (target) failed: OSError: disk")
    with caplog.at_level(logging.WARNING, logger="dflash_dist"), pytest.raises(SystemExit) as ei:
        train.run(drafter_rank)
    assert ei.value.code == 1
    assert "stopping without a checkpoint because rank 1 (target) failed: OSError: disk" in caplog.text
    assert STOPPED_AT_ONCE not in caplog.text
