"""Stopping on purpose and failing loudly, coordinated through torchrun's rendezvous store.

* Graceful stop (SIGTERM/SIGINT, e.g. SLURM preemption): the handler only sets a flag. The rank that got it
  posts ``stop_request`` in the store. The leader, at the end of step s, fixes ``stop_at = s + 2`` in the
  store; every drafter checks that key after each step, and since the data-parallel all-reduce of step s+1
  cannot finish before the leader has written it, all of them see it in time and stop after the same step.
  The leader checkpoints, targets stop producing at that key, send END, and every rank exits 0. Only this
  path writes a checkpoint.
* Failure: the failing rank writes its exception to ``failed`` (first writer wins) and exits non-zero;
  every other rank, when its wait on that peer breaks, reports that root cause instead of its own
  secondary error, so the real message is surfaced once.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
from typing import Optional

from dflash_dist.processes import pid_alive

log = logging.getLogger("dflash_dist")

KEY_STOP_REQUEST = "dflash/stop_request"
KEY_STOP_AT = "dflash/stop_at"
KEY_FAILED = "dflash/failed"
KEY_WHO = "dflash/who/"  # + rank: "host pid role"
STOPPED_AT_ONCE = "stopped at once on a second signal"  # a second Ctrl-C: posted under KEY_FAILED, not a crash
DIVERGED = "TrainingDiverged"  # roles/drafter_rank/trainer.TrainingDiverged, by name: a target never imports it


def exit_code_for(root: str) -> int:
    """The exit code of a rank that stops because another failed with ``root``: the job's code for that cause, so
    that the launcher reads one code from every rank however they raced: 3 when training diverged, 2 when a save
    failed (disk, quota: the user's to fix, like a setting), else 1."""
    if f"failed: {DIVERGED}: " in root:
        return 3
    if any(f"failed: {n}: " in root for n in ("CheckpointSaveError", "StorageError")):
        return 2
    return 1


class PeerFailure(RuntimeError):
    """Another rank failed; the message is that rank's own error."""


class Lifecycle:
    def __init__(self, store, rank: int, role: str, world_size: int, role_of=None, install_handlers: bool = True):
        self.store, self.rank, self.role, self.world_size = store, rank, role, world_size
        self.role_of = role_of or (lambda r: "?")
        self.signal_name: Optional[str] = None
        self.stop_now = False  # a second SIGINT: stop without a checkpoint
        self._posted = False
        self.host = socket.gethostname()
        store.set(f"{KEY_WHO}{rank}", f"{self.host} {os.getpid()} {role}")
        if install_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
            # a job that hangs: `pkill -USR1 -f dflash_dist.train` prints where every rank's Python is, to stderr
            faulthandler.register(signal.SIGUSR1, all_threads=True)

    def dead_peers(self) -> list[str]:
        """Ranks on this host whose process no longer exists (a kill -9, an OOM kill), e.g. 'rank 2 (target)'."""
        dead = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            try:
                host, pid, role = self.store.get(f"{KEY_WHO}{r}").decode().split()
            except Exception:
                continue
            if host != self.host:
                continue
            if not pid_alive(int(pid)):
                dead.append(f"rank {r} ({role}, pid {pid})")
        return dead

    def root_cause(self, settle_s: float = 1.0) -> Optional[str]:
        """Why the job is failing, if another rank is the cause: its reported error, or the ranks on this host
        that died. A broken connection can reach us a moment before the dead process is reaped, so look
        again for up to settle_s."""
        import time
        deadline = time.monotonic() + settle_s
        while True:
            f = self.failure()
            if f is not None:
                return f
            dead = self.dead_peers()
            if dead:
                return ", ".join(dead) + " died"
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)

    def _on_signal(self, signum, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            self.stop_now = True
            raise KeyboardInterrupt  # second Ctrl-C: stop now
        # torchrun also sends SIGTERM to the survivors when a rank dies: that is a failure, not a preemption.
        dead = self.dead_peers()
        failure = self.failure()
        if dead or failure:
            root = failure or (", ".join(dead) + " died")
            code = exit_code_for(root)
            if code != 3:  # a divergence is said once, by the drafters' leader
                log.error("stopping without a checkpoint because %s", root)
            from dflash_dist.checkpoint.claim import release_claims
            release_claims()
            os._exit(code)
        self.signal_name = signal.Signals(signum).name
        log.warning("received %s: finishing the current step, then checkpoint and exit", self.signal_name)

    def _has(self, key: str) -> bool:
        try:
            return self.store.check([key])
        except Exception:  # the store host is gone: treat as failure elsewhere, not as a stop
            return False

    def stop_requested(self) -> bool:
        """This rank got a signal, or another rank posted a stop request."""
        if self.signal_name is not None and not self._posted:
            self.store.set(KEY_STOP_REQUEST, f"rank {self.rank} ({self.role}): {self.signal_name}")
            self._posted = True
        return self.signal_name is not None or self._has(KEY_STOP_REQUEST)

    def stop_reason(self) -> Optional[str]:
        """Why a graceful stop is requested (this rank's signal, e.g. 'SIGTERM', or the request another rank posted),
        None while none is."""
        if not self.stop_requested():
            return None
        if self.signal_name is not None:
            return self.signal_name
        try:
            return self.store.get(KEY_STOP_REQUEST).decode("utf-8", "replace")
        except Exception:
            return "a stop requested by another rank"

    def announce_stop(self, step: int) -> None:
        self.store.set(KEY_STOP_AT, str(step))

    def stop_step(self) -> Optional[int]:
        """The step after which every drafter stops, once the leader has fixed it."""
        if not self._has(KEY_STOP_AT):
            return None
        return int(self.store.get(KEY_STOP_AT).decode())

    def report_failure(self, text: str) -> None:
        try:
            self.store.compare_set(KEY_FAILED, "", text)
        except Exception:
            pass

    def failure(self) -> Optional[str]:
        if not self._has(KEY_FAILED):
            return None
        try:
            return self.store.get(KEY_FAILED).decode("utf-8", "replace")
        except Exception:
            return None

    def check(self) -> None:
        """Raise PeerFailure if another rank has failed (called while waiting on peers)."""
        f = self.failure()
        if f is not None and not f.startswith(f"rank {self.rank} "):
            raise PeerFailure(f)
