"""Start torchrun jobs from tests (CPU, gloo) and collect their output."""

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_SHARED_CACHE: list = []


def shared_data_cache() -> str:
    """One tokenized-data cache for every job of a test session (``data.cache_dir``): the cache is keyed by the
    content of the data and tokenizer, so jobs on the same data share its tokenization, as users' runs can.
    Removed at exit."""
    if not _SHARED_CACHE:
        _SHARED_CACHE.append(tempfile.mkdtemp(prefix="dflash-test-data-cache-"))
        atexit.register(shutil.rmtree, _SHARED_CACHE[0], True)
    return _SHARED_CACHE[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, args: list, timeout: float = 300, env: dict | None = None, nnodes: int = 1,
             node_rank: int | None = None, rdzv: str | None = None, popen: bool = False, cwd: str | None = None,
             preexec_fn=None):
    """Run `torchrun --standalone` (or a c10d multi-node agent) on this machine; returns CompletedProcess.
    ``cwd``: the directory it runs in (default: the repository; runs without train.output_dir land in its outputs/).
    ``preexec_fn``: run in the child before torchrun starts (e.g. a resource limit every rank inherits).
    A training job without ``data.cache_dir`` uses the session's shared cache (``shared_data_cache``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1:
        cmd += ["--standalone", "--nproc-per-node", str(nproc)]
    else:
        cmd += ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", rdzv, "--rdzv-id", "dflash-test", "--node-rank", str(node_rank)]
    args = [str(a) for a in args]
    if "dflash_dist.train" in args and not any(a.startswith("data.cache_dir=") for a in args):
        args.append(f"data.cache_dir={shared_data_cache()}")
    cmd += args
    full_env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE=os.environ.get("WANDB_MODE", "offline"))
    full_env.update(env or {})
    if popen:
        return subprocess.Popen(cmd, cwd=cwd or REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True, preexec_fn=preexec_fn)
    return _run_or_report_hang(cmd, cwd or REPO, full_env, timeout, preexec_fn)


def _run_or_report_hang(cmd, cwd, env, timeout, preexec_fn) -> subprocess.CompletedProcess:
    """subprocess.run with capture, except that a job past ``timeout`` is not just killed: its ranks (torchrun's
    children) get SIGUSR1 first, so the failure shows every rank's Python stacks and the job's last output, and
    the whole session is killed (no orphaned rank keeps the machine busy for the next test)."""
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, preexec_fn=preexec_fn)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        ranks = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
        for pid in ranks:
            try:
                os.kill(int(pid), signal.SIGUSR1)  # faulthandler: every rank prints its stacks
            except ProcessLookupError:
                pass
        try:
            out, err = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
        else:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # ranks the launcher left behind
            except ProcessLookupError:
                pass
        raise AssertionError(f"{' '.join(cmd[2:])}\ntimed out after {timeout:.0f} s; its ranks' stacks and last "
                             f"output:\n{(out + err)[-12000:]}") from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def signal_once_reached(p: subprocess.Popen, reached, send, settle_s: float = 2.0, wait_s: float = 240,
                        exit_s: float = 180) -> tuple[str, float]:
    """Wait until ``reached()`` (the job still running), ``settle_s`` more, then ``send()`` (a signal to the job or
    its workers): (the job's output, seconds from the signal to its exit). A job still running is killed."""
    import time
    try:
        deadline = time.monotonic() + wait_s
        while not reached():
            assert p.poll() is None and time.monotonic() < deadline, "not reached before the job ended or timed out"
            time.sleep(0.2)
        time.sleep(settle_s)
        send()
        t0 = time.monotonic()
        out = p.communicate(timeout=exit_s)[0]
        return out, time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
