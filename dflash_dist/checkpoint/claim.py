"""One run directory, one job: rank 0 holds an exclusive claim on its run directory for the job's life.

The claim is a file, ``<run_dir>/.dflash-claim``, created with ``O_CREAT | O_EXCL`` (atomic on local disks and
on NFS v3+, unlike ``flock``), holding who took it: host, pid, the process's start time, its PID namespace and
boot id, the job id (SLURM_JOB_ID / TORCHELASTIC_RUN_ID) and a random token. The holder refreshes the file's mtime
every ``HEARTBEAT_S`` (a daemon thread that only touches the file). A claim whose holder is gone is stale and is
taken over with a warning: when its pid no longer runs or runs another process (another start time), judged only
where that pid means the same process as here (same host name, PID namespace and boot); elsewhere (another host, a
container with the host's name in its own PID namespace, another boot, a claim that does not say) only once its
heartbeat is older than ``STALE_AFTER_S``, never while it is live; anywhere when it is an earlier launch of this
same job (same SLURM job and step or torchrun run id, a lower restart count). Released on every exit path that
can run code (the exit paths of ``train`` and the lifecycle call ``release_claims``; atexit covers the rest);
a ``kill -9`` leaves it behind, which the next job detects as stale.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Optional

from dflash_dist.config import ConfigError
from dflash_dist.processes import pid_alive

log = logging.getLogger("dflash_dist")

CLAIM_FILE = ".dflash-claim"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0  # a holder on another host whose heartbeat is older than this is gone
WRITING_S = 5.0  # an empty claim file younger than this is being written (O_EXCL create, then the record)
_JOB_ID_VARS = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
# a later launch of the same job (SLURM requeue, a torchrun restart): its earlier workers were all stopped first
_RESTART_VARS = (("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT"),
                 ("TORCHELASTIC_RUN_ID", None, "TORCHELASTIC_RESTART_COUNT"))


def process_start(pid: int) -> Optional[int]:
    """The start time of a process in clock ticks since boot (/proc/<pid>/stat field 22), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_namespace() -> Optional[str]:
    """This process's PID namespace (``pid:[inode]``), None where /proc does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def boot_id() -> Optional[str]:
    """This boot of the machine (a pid and a namespace inode are only meaningful within one), None if unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def pid_space_differs(holder: dict) -> Optional[str]:
    """Why the holder's pid may not name the same process here (None: it does: same PID namespace and boot).
    Containers with host networking share the host name, not the process table."""
    if "pid_ns" not in holder or "boot_id" not in holder:
        return "the claim does not record its PID namespace"
    if holder["boot_id"] != boot_id():
        return "it was made in another boot or on another machine of this name"
    if holder["pid_ns"] != pid_namespace():
        return f"it runs in another PID namespace ({holder['pid_ns']})"
    return None


def describe(holder: dict) -> str:
    job = ", ".join(f"{k}={holder[k]}" for k in _JOB_ID_VARS if holder.get(k)) or "no job id"
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}, {job}"


def _restarted(holder: dict, env=os.environ) -> Optional[str]:
    """The holder is an earlier launch of this very job (same job id and step, a lower restart count)."""
    for job, step, count in _RESTART_VARS:
        if not env.get(job) or holder.get(job) != env.get(job) or (step and holder.get(step) != env.get(step)):
            continue
        try:
            if int(holder.get(count) or 0) < int(env.get(count) or 0):
                return f"it is an earlier launch of this job ({job}={env[job]}, {count} {holder.get(count) or 0})"
        except ValueError:
            pass
    return None


def stale_reason(holder: dict, mtime: float, now: Optional[float] = None) -> Optional[str]:
    """Why a claim's holder is gone (the claim can be taken over), or None while it may still run."""
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return f"the claim file names no pid (unreadable for more than {WRITING_S:.0f} s)"
    restarted = _restarted(holder)
    if restarted:
        return restarted
    elsewhere = pid_space_differs(holder) if holder.get("host") == socket.gethostname() else None
    if holder.get("host") == socket.gethostname() and elsewhere is None:
        if not os.path.exists("/proc/self/stat"):  # no /proc: the pid alone
            return None if pid_alive(pid) else f"pid {pid} is gone"
        start = process_start(pid)
        if start is None:
            return f"pid {pid} is gone"
        if holder.get("start_ticks") is not None and start != holder["start_ticks"]:
            return f"pid {pid} is another process now (it started later)"
        return None
    # not provably gone by its pid: only a heartbeat older than the bound says so
    age = (now or time.time()) - mtime
    if age > STALE_AFTER_S:
        return (f"its heartbeat is {age:.0f} s old (a live holder refreshes it every {HEARTBEAT_S:.0f} s)"
                + (f"; its pid is not checked here: {elsewhere}" if elsewhere else ""))
    return None


class RunClaim:
    """The claim this process holds on one run directory."""

    def __init__(self, run_dir: str, record: dict, made_dir: bool):
        self.run_dir, self.record, self.made_dir = run_dir, record, made_dir
        self.path = os.path.join(run_dir, CLAIM_FILE)
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="dflash-claim-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        """Remove the claim file if it is still ours (and the run directory, if the claim made it and it is empty)."""
        self._stop.set()
        if _read(self.path)[0].get("token") == self.record["token"]:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        if self.made_dir:
            try:
                os.rmdir(self.run_dir)
            except OSError:
                pass
        if self in _HELD:
            _HELD.remove(self)


_HELD: list = []


def release_claims() -> None:
    """Release every claim this process holds (called on the job's exit paths, before os._exit)."""
    for c in list(_HELD):
        c.release()


atexit.register(release_claims)


def _read(path: str) -> tuple[dict, float]:
    try:
        with open(path) as f:
            rec = json.load(f)
        return (rec if isinstance(rec, dict) else {}), os.path.getmtime(path)
    except (OSError, ValueError):
        try:
            return {}, os.path.getmtime(path)
        except OSError:
            return {}, 0.0


def _record() -> dict:
    rec = {"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": process_start(os.getpid()),
           "pid_ns": pid_namespace(), "boot_id": boot_id(),
           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "token": uuid.uuid4().hex}
    rec.update({k: os.environ[k] for g in _RESTART_VARS for k in g if k and os.environ.get(k)})
    return rec


def _create(path: str, rec: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(rec, f)
        f.flush()
        os.fsync(f.fileno())
    return True


def _take_over(path: str, stale: dict) -> None:
    """Move a stale claim aside (atomic rename), then check that what was moved is the stale one: a job that took
    it over in the meantime gets its claim back (os.link: only if none is there again)."""
    aside = f"{path}.stale-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    moved, _ = _read(aside)
    if moved != stale:
        try:
            os.link(aside, path)
        except OSError:
            pass
    os.unlink(aside)


def claim_run_dir(run_dir: str, what: str = "train.output_dir") -> RunClaim:
    """Take the claim on ``run_dir`` (created if missing), or raise a ConfigError naming the live holder (a
    StorageError when the disk refuses the directory or the claim file)."""
    from dflash_dist.storage import writing
    with writing(os.path.join(run_dir, CLAIM_FILE), f"the claim of {what}={run_dir}"):
        return _claim_run_dir(run_dir, what)


def _claim_run_dir(run_dir: str, what: str) -> RunClaim:
    made_dir = not os.path.isdir(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    path, rec = os.path.join(run_dir, CLAIM_FILE), _record()
    for _ in range(100):
        if _create(path, rec):
            claim = RunClaim(run_dir, rec, made_dir)
            _HELD.append(claim)
            return claim
        holder, mtime = _read(path)
        if not holder and time.time() - mtime < WRITING_S:  # created, its record not written yet: look again
            time.sleep(0.1)
            continue
        if holder.get("token") and any(c.record["token"] == holder["token"] for c in _HELD):
            return next(c for c in _HELD if c.record["token"] == holder["token"])  # this process holds it
        why = stale_reason(holder, mtime)
        if why is None:
            elsewhere = pid_space_differs(holder) if holder.get("host") == socket.gethostname() else None
            live = (f"; {elsewhere}: live while its heartbeat (the file's mtime) is under {STALE_AFTER_S:.0f} s old, "
                    f"now {time.time() - mtime:.0f} s" if elsewhere else "")
            raise ConfigError(
                f"{what}={run_dir} is in use by another job ({describe(holder)}; claim file {path}{live}): one run "
                f"directory takes one job. Wait for that job to end or stop it, or set another {what}.")
        log.warning("run directory %s: a stale claim left by a job that did not end cleanly (%s): %s; taking "
                    "it over", run_dir, describe(holder), why)
        _take_over(path, holder)
    raise ConfigError(f"{what}={run_dir}: could not take the claim file {path} (other jobs keep taking it)")
