"""comm/lifecycle.py without processes: why a graceful stop is requested, and the code a rank exits with when the
launcher's SIGTERM reaches it after another rank failed."""

import logging
import os
import signal

import pytest

from dflash_dist.comm.lifecycle import KEY_FAILED, KEY_STOP_REQUEST, Lifecycle, exit_code_for


class Store:
    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value.encode()

    def get(self, key):
        return self.values[key]

    def check(self, keys):
        return all(k in self.values for k in keys)


def test_stop_reason_is_this_ranks_signal_or_the_request_another_rank_posted():
    store = Store()
    target = Lifecycle(store, 1, "target", 2, install_handlers=False)
    drafter = Lifecycle(store, 0, "drafter", 2, install_handlers=False)
    assert target.stop_reason() is None and drafter.stop_reason() is None
    drafter.signal_name = "SIGTERM"  # what its handler sets
    assert drafter.stop_reason() == "SIGTERM"  # and posts the request
    assert store.values[KEY_STOP_REQUEST] == b"rank 0 (drafter): SIGTERM"
    assert target.stop_reason() == "rank 0 (drafter): SIGTERM"


DIVERGED = "rank 0 (drafter) failed: TrainingDiverged: training diverged at step 2: the loss was not finite"


@pytest.mark.parametrize("root, code", [
    (DIVERGED, 3),
    ("rank 0 (drafter) failed: CheckpointSaveError: saving checkpoint /r/step_2 failed: disk full", 2),
    ("rank 1 (target) failed: StorageError: the run directory is not writable", 2),
    ("rank 0 (drafter) failed: RuntimeError: CUDA error", 1),
    ("rank 2 (target, pid 7) died", 1),
])
def test_a_peers_failure_gives_the_jobs_exit_code(root, code):
    assert exit_code_for(root) == code


class Exited(Exception):
    pass


@pytest.mark.parametrize("root, code, logged", [(DIVERGED, 3, False),
                                                ("rank 0 (drafter) failed: RuntimeError: bad", 1, True)])
def test_the_launchers_sigterm_after_a_peer_failed_exits_with_the_jobs_code(monkeypatch, caplog, root, code,
                                                                            logged):
    """The launcher sends SIGTERM to the other ranks when one exits: a target that gets it before it noticed the
    drafters' divergence still exits 3 (the launcher reports 3 only when no rank says otherwise) and leaves the one
    line about it to the drafters' leader."""
    def fake_exit(c):
        raise Exited(c)
    monkeypatch.setattr(os, "_exit", fake_exit)
    store = Store()
    store.values[KEY_FAILED] = root.encode()
    target = Lifecycle(store, 1, "target", 2, install_handlers=False)
    with caplog.at_level(logging.ERROR, logger="dflash_dist"), pytest.raises(Exited) as ex:
        target._on_signal(signal.SIGTERM, None)
    assert ex.value.args == (code,)
    assert (root in caplog.text) == logged
    assert target.signal_name is None  # a failure, not a graceful stop
