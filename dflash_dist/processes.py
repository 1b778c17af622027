"""Whether a process on this machine still runs: the one check the run claim and the ranks' failure reports share."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a killed worker stays a zombie until its parent reaps it). Without
    /proc, whether the pid exists (a process of another user counts as alive)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
