"""processes.pid_alive: a running process is alive; a zombie and a reaped pid are not."""

import os
import subprocess
import sys
import time

from dflash_dist.processes import pid_alive


def test_running_zombie_and_reaped():
    assert pid_alive(os.getpid())
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while pid_alive(p.pid):  # exited, not reaped yet: a zombie until wait()
        assert time.monotonic() < deadline, "the child neither ran nor became a zombie"
        time.sleep(0.01)
    assert os.path.exists(f"/proc/{p.pid}") or not os.path.exists("/proc/self/stat")  # still in the table
    p.wait()
    assert not pid_alive(p.pid)
