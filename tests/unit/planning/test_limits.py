"""planning/limits.py: the memory a rank may use, read from cgroups (v2 and v1) and ``ulimit -v``."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers.launch_util import REPO

from dflash_dist.planning import limits as L


def test_cpu_limits_read_cgroups_and_ulimit(monkeypatch, tmp_path):
    files = {"/sys/fs/cgroup/memory.max": 2 * L.GiB, "/sys/fs/cgroup/memory.current": L.GiB // 2}
    monkeypatch.setattr(L, "_read_int", lambda p: files.get(p))
    left, what = L.cpu_available()
    assert left == int(1.5 * L.GiB) and "cgroup memory limit (2.00 GiB" in what
    files.clear()
    files.update({"/sys/fs/cgroup/memory/memory.limit_in_bytes": L.GiB,
                  "/sys/fs/cgroup/memory/memory.usage_in_bytes": 0})
    assert L.cpu_available()[0] == L.GiB
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30));"
            "from dflash_dist.planning.limits import address_space_left; print(address_space_left())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=REPO)).stdout
    assert "ulimit -v (8.00 GiB" in out and 0 < int(out.split("(")[1].split(",")[0]) < 8 << 30


def test_format_bytes_names_the_largest_unit():
    assert L.format_bytes(3 * L.GiB // 2) == "1.50 GiB" and L.format_bytes(2048) == "2.00 KiB"
    assert L.format_bytes(512) == "512 B"
