"""Start torchrun jobs from tests (CPU, gloo) and collect their output."""

import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, args: list, timeout: float = 300, env: dict | None = None, nnodes: int = 1,
             node_rank: int | None = None, rdzv: str | None = None, popen: bool = False, cwd: str | None = None):
    """Run `torchrun --standalone` (or a c10d multi-node agent) on this machine; returns CompletedProcess.
    ``cwd``: the directory it runs in (default: the repository; runs without train.output_dir land in its outputs/)."""
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1:
        cmd += ["--standalone", "--nproc-per-node", str(nproc)]
    else:
        cmd += ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", rdzv, "--rdzv-id", "dflash-test", "--node-rank", str(node_rank)]
    cmd += [str(a) for a in args]
    full_env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE=os.environ.get("WANDB_MODE", "offline"))
    full_env.update(env or {})
    if popen:
        return subprocess.Popen(cmd, cwd=cwd or REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    return subprocess.run(cmd, cwd=cwd or REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
