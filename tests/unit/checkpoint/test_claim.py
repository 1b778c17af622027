"""The run directory's claim: exclusive across processes, the holder named, stale claims (dead pid, a pid now
another process, an old heartbeat of another host, PID namespace or boot) taken over with a warning, a live
heartbeat never, released on exit."""

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from dflash_dist.checkpoint import claim as claimmod
from dflash_dist.checkpoint.claim import CLAIM_FILE, claim_run_dir, process_start
from dflash_dist.config import ConfigError

_HOLD = r"""
import sys, time
from dflash_dist.checkpoint.claim import claim_run_dir
claim_run_dir(sys.argv[1])
print("held", flush=True)
time.sleep(60)
"""


def _holder(run_dir):
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def _write_claim(run_dir, **rec):
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, CLAIM_FILE)
    with open(path, "w") as f:
        json.dump(dict({"host": socket.gethostname(), "started": "2026-01-01 00:00:00", "token": "x",
                        "pid_ns": claimmod.pid_namespace(), "boot_id": claimmod.boot_id()}, **rec), f)
    return path


def test_a_live_holder_is_named_and_a_released_claim_is_free(tmp_path):
    run = tmp_path / "run"
    p = _holder(run)
    try:
        with pytest.raises(ConfigError) as e:
            claim_run_dir(str(run))
        msg = str(e.value)
        assert f"train.output_dir={run} is in use by another job" in msg
        assert f"pid {p.pid}" in msg and socket.gethostname() in msg
    finally:
        p.kill()
        p.wait()
    # its process is gone (kill -9: nothing released): stale, taken over
    c = claim_run_dir(str(run))
    assert json.load(open(run / CLAIM_FILE))["pid"] == os.getpid()
    c.release()
    assert not os.path.exists(run / CLAIM_FILE)
    assert os.path.isdir(run)  # it existed before this claim: left in place


def test_a_claim_of_a_dead_pid_is_stale_and_said_so(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = tmp_path / "run"
    _write_claim(run, pid=dead.pid, start_ticks=1, SLURM_JOB_ID="77")
    with caplog.at_level(logging.WARNING):
        c = claim_run_dir(str(run))
    assert "stale claim" in caplog.text and f"pid {dead.pid} is gone" in caplog.text
    assert "SLURM_JOB_ID=77" in caplog.text
    c.release()


def test_a_pid_that_is_another_process_now_is_stale(tmp_path, caplog):
    run = tmp_path / "run"
    # this very process, with another start time: the pid was reused
    _write_claim(run, pid=os.getpid(), start_ticks=process_start(os.getpid()) - 1)
    with caplog.at_level(logging.WARNING):
        c = claim_run_dir(str(run))
    assert "is another process now" in caplog.text
    c.release()


def test_another_hosts_claim_is_live_until_its_heartbeat_is_old(tmp_path, monkeypatch):
    run = tmp_path / "run"
    path = _write_claim(run, host="node-elsewhere", pid=12345, start_ticks=5)
    with pytest.raises(ConfigError, match="host node-elsewhere, pid 12345"):
        claim_run_dir(str(run))
    old = time.time() - claimmod.STALE_AFTER_S - 10
    os.utime(path, (old, old))
    c = claim_run_dir(str(run))
    assert json.load(open(path))["host"] == socket.gethostname()
    c.release()


def test_a_claim_this_process_made_is_released_with_the_directory_it_made(tmp_path):
    run = tmp_path / "new"
    c = claim_run_dir(str(run))
    assert claim_run_dir(str(run)) is c  # the same process asks again (rank 0 re-resolving): its own claim
    claimmod.release_claims()
    assert not os.path.exists(run)


def test_the_heartbeat_refreshes_the_claim(tmp_path, monkeypatch):
    monkeypatch.setattr(claimmod, "HEARTBEAT_S", 0.05)
    run = tmp_path / "run"
    c = claim_run_dir(str(run))
    old = time.time() - 1000
    os.utime(run / CLAIM_FILE, (old, old))
    time.sleep(0.3)
    assert time.time() - os.path.getmtime(run / CLAIM_FILE) < 10
    c.release()


def test_an_earlier_launch_of_the_same_job_on_another_host_is_stale_at_once(tmp_path, monkeypatch):
    """A requeued SLURM job (same job and step id, a higher restart count) takes over the claim its first launch
    left on a lost node, without waiting for the heartbeat to age; another step of the same allocation does not."""
    run = tmp_path / "run"
    path = _write_claim(run, host="lost-node", pid=99, SLURM_JOB_ID="5", SLURM_STEP_ID="0", SLURM_RESTART_COUNT="0")
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setenv("SLURM_STEP_ID", "1")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.raises(ConfigError, match="host lost-node"):
        claim_run_dir(str(run))  # another step of the allocation: may still run
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    c = claim_run_dir(str(run))
    assert json.load(open(path))["SLURM_RESTART_COUNT"] == "1"
    c.release()


def test_a_claim_file_still_being_written_is_not_taken_over(tmp_path, monkeypatch):
    """Between another job's O_EXCL create and its record the file is empty: wait for the record, do not take it."""
    monkeypatch.setattr(claimmod, "WRITING_S", 0.5)
    run = tmp_path / "run"
    os.makedirs(run)
    (run / CLAIM_FILE).write_text("")
    calls = []
    real_read = claimmod._read

    def read_then_written(path):
        calls.append(path)
        if len(calls) == 2:  # the record lands while this job waits
            _write_claim(run, host="node-elsewhere", pid=4321, start_ticks=1)
        return real_read(path)

    monkeypatch.setattr(claimmod, "_read", read_then_written)
    with pytest.raises(ConfigError, match="pid 4321"):
        claim_run_dir(str(run))
    # empty for longer than that: unreadable, stale
    (run / CLAIM_FILE).write_text("")
    old = time.time() - 10
    os.utime(run / CLAIM_FILE, (old, old))
    monkeypatch.setattr(claimmod, "_read", real_read)
    claim_run_dir(str(run)).release()


def _dead_pid():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def test_the_claim_records_its_pid_namespace_and_boot(tmp_path):
    c = claim_run_dir(str(tmp_path / "run"))
    rec = json.load(open(tmp_path / "run" / CLAIM_FILE))
    assert rec["pid_ns"] == os.readlink("/proc/self/ns/pid") and rec["pid_ns"].startswith("pid:[")
    assert rec["boot_id"] == open("/proc/sys/kernel/random/boot_id").read().strip()
    c.release()


@pytest.mark.parametrize("where", ["namespace", "boot", "unrecorded"])
def test_a_live_claim_from_another_pid_namespace_or_boot_is_never_taken_over(tmp_path, monkeypatch, caplog, where):
    """A container with the host's name and its own PID namespace: its pid means nothing here (this one is gone
    here), so only its heartbeat can say it is gone; while that is live the claim is refused, naming why."""
    run = tmp_path / "run"
    rec = {"namespace": {"pid_ns": "pid:[4026539999]"}, "boot": {"boot_id": "another-boot"}, "unrecorded": {}}[where]
    path = _write_claim(run, pid=_dead_pid(), start_ticks=1, **rec)
    if where == "unrecorded":  # a claim that does not say where its pid lives
        holder = json.load(open(path))
        del holder["pid_ns"], holder["boot_id"]
        json.dump(holder, open(path, "w"))
    with pytest.raises(ConfigError) as e:
        claim_run_dir(str(run))
    assert "is in use by another job" in str(e.value) and "heartbeat" in str(e.value)
    assert {"namespace": "another PID namespace (pid:[4026539999])", "boot": "another boot",
            "unrecorded": "does not record its PID namespace"}[where] in str(e.value)
    # still live just under the bound; gone once its heartbeat is older
    fresh = time.time() - claimmod.STALE_AFTER_S + 30
    os.utime(path, (fresh, fresh))
    with pytest.raises(ConfigError):
        claim_run_dir(str(run))
    old = time.time() - claimmod.STALE_AFTER_S - 10
    os.utime(path, (old, old))
    with caplog.at_level(logging.WARNING):
        c = claim_run_dir(str(run))
    assert "heartbeat is" in caplog.text and "its pid is not checked here" in caplog.text
    assert json.load(open(path))["token"] == c.record["token"]
    c.release()


def test_this_process_seen_from_another_namespace_is_judged_by_its_heartbeat(tmp_path, monkeypatch):
    """The other way round: the claim is this namespace's, the checker runs in another one (faked): a pid that is
    gone in the checker's table proves nothing, the live heartbeat keeps the claim."""
    run = tmp_path / "run"
    _write_claim(run, pid=_dead_pid(), start_ticks=1)
    monkeypatch.setattr(claimmod, "pid_namespace", lambda: "pid:[4026530001]")
    with pytest.raises(ConfigError, match="another PID namespace"):
        claim_run_dir(str(run))
    monkeypatch.undo()
    c = claim_run_dir(str(run))  # in the same namespace the dead pid proves it gone at once
    c.release()
