"""The memory a rank may use: a GPU's, or on CPU the machine's available memory (cgroup limits included) that its
ranks share, and what ``ulimit -v`` leaves each process. ``planning/memory.py`` compares its plans with these."""

from __future__ import annotations

import os
import resource
from typing import Optional

__all__ = ["GiB", "format_bytes", "cpu_available", "address_space_left", "device_memory"]

GiB = 1 << 30


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            v = f.read().split()[0]
    except (OSError, IndexError):
        return None
    return int(v) if v.isdigit() else None


def _proc_kib(field_name: str, path: str = "/proc/meminfo") -> Optional[int]:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_available() -> tuple[int, str]:
    """(bytes, what) the machine's memory left to new processes: MemAvailable, or less under a cgroup limit
    (v2 memory.max less memory.current, v1 memory.limit_in_bytes less memory.usage_in_bytes)."""
    avail = _proc_kib("MemAvailable") or int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    best = (avail, "available memory")
    for limit_p, used_p in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                            ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                             "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit = _read_int(limit_p)
        if limit is not None and limit < (1 << 60):
            left = limit - (_read_int(used_p) or 0)
            if left < best[0]:
                best = (left, f"the cgroup memory limit ({format_bytes(limit)}, {limit_p})")
    return best


def address_space_left() -> Optional[tuple[int, str]]:
    """(bytes, what) this process may still map under ``ulimit -v`` (RLIMIT_AS less its VmSize), or None."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    used = _proc_kib("VmSize", "/proc/self/status") or 0
    return soft - used, f"ulimit -v ({format_bytes(soft)}, {format_bytes(used)} mapped already)"


def device_memory(device: str) -> tuple[int, str]:
    """(bytes, what) of one device: a GPU's total memory (each rank has its own), or the CPU machine's available
    memory, which its ranks share."""
    if device == "cuda":
        import torch
        if torch.cuda.is_available():
            i = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
            props = torch.cuda.get_device_properties(i)
            return int(props.total_memory), f"{props.name}'s memory"
        return 0, "no GPU"
    return cpu_available()
