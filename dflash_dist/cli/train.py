"""``dflash-train [--nproc-per-node N] [overrides]``: one training job on this machine, ranks started here.

The checks that need no model run first, in this process (a wrong setting is printed once, exit 2, no rank
started); ``--help`` and ``--cfg job`` stop there. Then torch's elastic launcher (what torchrun runs, a standalone
rendezvous on a free port) starts ``python -m dflash_dist.train`` once per rank. A configuration or data error of
the ranks (they print it once and exit 2) ends this process with 2 as well, without the launcher's report; a
diverged training (``train.max_nonfinite_steps``: the leader prints one line, the ranks exit 3) with 3. Ctrl-C
or SIGTERM is passed on to the ranks as SIGTERM, the graceful stop of ``comm/lifecycle.py`` (one checkpoint);
then the command that continues the run is printed and this process exits 128 + the signal (130 / 143).
Several nodes or SLURM: ``torchrun -m dflash_dist.train`` (``launch/multinode.sh``, ``launch/slurm.sbatch``).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import sys
import tempfile
import uuid
from typing import Optional

from dflash_dist.config import ConfigError
from dflash_dist.data.conversations import DataError
from dflash_dist.paths import CONF_DIR

LAUNCH_INFO_ENV = "DFLASH_LAUNCH_INFO"  # a file rank 0 writes the run directory to (train.tell_launcher)
RANK_MODULE = "dflash_dist.train"


class Stopped(Exception):
    """A stop signal before any rank was running: nothing to checkpoint."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def parse_args(argv: list[str]) -> tuple[Optional[int], Optional[str], bool, list[str]]:
    """(nproc or None, ``--cfg`` value or None, --help, the Hydra overrides). Unknown options are refused."""
    nproc, cfg, want_help, overrides = None, None, False, []
    it = iter(argv)
    for a in it:
        name, eq, val = a.partition("=")
        if a in ("-h", "--help"):
            want_help = True
        elif name in ("--nproc-per-node", "--nproc_per_node"):
            val = val if eq else next(it, "")
            if not val.isdigit() or int(val) < 1:
                raise ConfigError(f"--nproc-per-node {val!r}: give the number of processes, an integer >= 1")
            nproc = int(val)
        elif name in ("--cfg", "-c"):
            cfg = val if eq else next(it, "")
            if cfg != "job":
                raise ConfigError(f"--cfg {cfg!r}: only '--cfg job' (the resolved job config) is supported")
        elif a.startswith("-"):
            raise ConfigError(f"unknown option {a!r}: dflash-train takes --nproc-per-node N, --cfg job, --help and "
                              f"key=value overrides (dflash-train --help lists them)")
        else:
            overrides.append(a)
    return nproc, cfg, want_help, overrides


def default_nproc() -> int:
    """One process per visible GPU (one GPU: one colocated rank); 3 on a machine without one (the default job:
    1 target + 2 drafters)."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 3


def check_gpus(device_type: str, nproc: int) -> None:
    """One process per GPU: two ranks of one NCCL job cannot share a device (the second would find no device of
    its own). Raises ConfigError naming what works."""
    if device_type != "cuda":
        return
    import torch
    gpus = torch.cuda.device_count()
    if nproc > gpus:
        raise ConfigError(f"--nproc-per-node {nproc} on a machine with {gpus} GPU(s): start one process per GPU "
                          f"(--nproc-per-node {gpus}, the default); with {gpus} process(es) every rank can hold both "
                          f"roles (topology.target_ranks=0, what one process does anyway)")


def check(overrides: list[str], world_size: int):
    """The job's config (Hydra's ``DictConfig``) after the checks training runs before any model loads: the
    overrides, every field, the device, the split for ``world_size`` ranks on one node, the target's HF config
    and tokenizer, layer ids, drafter shape, fast paths, the data source (job.check_job_config). Raises ConfigError."""
    from dflash_dist.config import JobConfig, check_overrides, compose_config, resolve_device
    from dflash_dist.job import check_job_config
    check_overrides(overrides, CONF_DIR)
    dcfg = compose_config(overrides, CONF_DIR)
    cfg = JobConfig.from_omegaconf(dcfg)
    device_type = resolve_device(cfg)
    check_gpus(device_type, world_size)
    check_job_config(cfg, world_size, device_type)  # the split of one node included (config.check_split)
    if cfg.topology.plan:  # the plan's split, typed and checked against the world size (the ranks read it again)
        from dflash_dist.planning.startup import split_from_plan_file
        split_from_plan_file(cfg.topology.plan, world_size)
    return dcfg


def rank_environment(nproc: int) -> None:
    """What launch/env.sh sets for torchrun jobs, each only where the user has not: threads per rank (the cores
    shared among the ranks), NCCL's multicast off, NCCL errors that end the job, unbuffered output."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    import torch
    if torch.cuda.is_available() and not os.environ.get("PYTORCH_ALLOC_CONF"):
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def worker_pids() -> list[int]:
    """This process's children that run a rank (the elastic agent starts each in a session of its own, so a
    terminal's Ctrl-C reaches only this process)."""
    pids = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            continue
    ranks = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if RANK_MODULE.encode() in f.read().split(b"\0"):
                    ranks.append(pid)
        except OSError:
            continue
    return ranks


class SignalRelay:
    """SIGINT/SIGTERM to this process: the first is passed to every rank as SIGTERM (finish the step, checkpoint,
    exit 0); the second as SIGINT (the ranks stop at once, no checkpoint); a third kills them. Before any rank
    runs: ``Stopped``."""

    def __init__(self):
        self.signum: Optional[int] = None
        self.count = 0
        self.before = {sig: signal.signal(sig, self.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore(self) -> None:
        for sig, handler in self.before.items():
            signal.signal(sig, handler)

    def on_signal(self, signum, frame) -> None:
        self.signum = self.signum or signum
        self.count += 1
        pids = worker_pids()
        if not pids:
            raise Stopped(self.signum)
        name = signal.Signals(signum).name
        if self.count == 1:
            print(f"dflash-train: {name}: the ranks finish the current step, write a checkpoint and stop "
                  f"(Ctrl-C again: stop now, without a checkpoint)", file=sys.stderr, flush=True)
        else:
            print(f"dflash-train: {name} again: {'stopping' if self.count == 2 else 'killing'} the ranks now, "
                  f"without a checkpoint", file=sys.stderr, flush=True)
        forward = {1: signal.SIGTERM, 2: signal.SIGINT}.get(self.count, signal.SIGKILL)
        for pid in pids:
            try:
                os.kill(pid, forward)
            except ProcessLookupError:
                pass


def launch(nproc: int, overrides: list[str], info_path: str) -> None:
    """Run the ranks under torch's elastic agent; raises ChildFailedError when a rank failed. SIGINT and SIGTERM
    are left to ``SignalRelay`` (the agent's own handlers would stop the ranks without a checkpoint)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          signals_to_handle="SIGHUP,SIGQUIT")
    os.environ[LAUNCH_INFO_ENV] = info_path
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_ReportedHere())
    elastic_launch(config, sys.executable)("-u", "-m", RANK_MODULE, *overrides)


def resume_command(nproc: int, overrides: list[str], run_dir: str) -> str:
    """The command that continues this run: the same overrides, its directory, train.resume=auto."""
    kept = [o for o in overrides if not o.lstrip("+").startswith(("train.output_dir=", "train.resume="))]
    args = ["dflash-train", "--nproc-per-node", str(nproc), *kept, f"train.output_dir={run_dir}",
            "train.resume=auto"]
    return " ".join(shlex.quote(a) for a in args)


def _run_dir(info_path: str) -> Optional[str]:
    try:
        with open(info_path) as f:
            return json.load(f)["run_dir"]
    except (OSError, ValueError, KeyError):
        return None


def after_stop(relay: SignalRelay, failed: bool, nproc: int, overrides: list[str], info_path: str) -> int:
    """After a stop signal: where the checkpoint is and how to continue; 128 + the signal."""
    name = signal.Signals(relay.signum).name
    run_dir = _run_dir(info_path)
    if failed or run_dir is None:
        print(f"dflash-train: stopped on {name} without a checkpoint", file=sys.stderr, flush=True)
    else:
        from dflash_dist.checkpoint.store import find_latest
        latest = find_latest(run_dir)
        print(f"dflash-train: stopped on {name}; checkpoint: {latest or 'none (no step finished)'}\n"
              f"dflash-train: to continue: {resume_command(nproc, overrides, run_dir)}", file=sys.stderr, flush=True)
    return 128 + relay.signum


class _ReportedHere:
    """Drops the elastic agent's log lines about failed or stopped ranks: this process reports them itself
    (nothing more for a configuration or data error, which a rank printed; else ``failure_summary``)."""

    def filter(self, record) -> bool:
        return not str(record.msg).startswith(("failed (exitcode", "Sending process"))


def failure_summary(err) -> str:
    """One line: each failed rank's exit code or signal, the first to fail first."""
    failures = sorted(err.failures.items(), key=lambda kv: kv[1].timestamp)
    parts = [f"rank {r} " + (f"exit code {f.exitcode}" if f.exitcode >= 0 else f"killed by {f.signal_name()}")
             for r, f in failures]
    return "dflash-train: the job failed: " + ", ".join(parts) + " (the first rank's error is printed above)"


def usage_failure(err, code: int = 2) -> bool:
    """The ranks stopped on a configuration or data error (each exits 2; the agent's SIGTERM may end a rank that
    was still on its way to it); ``code`` 3: on a diverged training (train.max_nonfinite_steps)."""
    codes = {f.exitcode for f in err.failures.values()}
    return code in codes and all(c == code or c < 0 for c in codes)


def train(relay: SignalRelay, nproc: int, overrides: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    rank_environment(nproc)
    fd, info_path = tempfile.mkstemp(prefix="dflash-launch-", suffix=".json")
    os.close(fd)
    try:
        launch(nproc, overrides, info_path)
    except ChildFailedError as e:
        if relay.signum is not None:
            return after_stop(relay, True, nproc, overrides, info_path)
        if usage_failure(e):
            return 2  # a rank printed what to change
        if usage_failure(e, 3):
            return 3  # the leader printed why training diverged
        print(failure_summary(e), file=sys.stderr, flush=True)
        return 1
    else:
        if relay.signum is not None:
            return after_stop(relay, False, nproc, overrides, info_path)
        return 0
    finally:
        os.unlink(info_path)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    relay = SignalRelay()  # from here on a Ctrl-C ends this process without a traceback
    try:
        nproc, cfg, want_help, overrides = parse_args(argv)
        if want_help:
            from dflash_dist.cli.help import render_help
            from dflash_dist.config import compose_config
            print(render_help(CONF_DIR, _container(compose_config([], CONF_DIR))))
            return 0
        if int(os.environ.get("SLURM_STEP_NUM_TASKS", "1") or 1) > 1:  # each task would start a job of its own
            raise ConfigError("dflash-train starts the ranks of one node itself: run it once per job, not as one "
                              "of several srun tasks (several nodes: launch/slurm.sbatch, torchrun)")
        nproc = nproc or default_nproc()
        dcfg = check(overrides, nproc)
        if cfg == "job":
            from omegaconf import OmegaConf
            print(OmegaConf.to_yaml(dcfg, resolve=True), end="")
            return 0
        return train(relay, nproc, overrides)
    except (ConfigError, DataError) as e:
        kind = "configuration error" if isinstance(e, ConfigError) else "data error"
        print(f"dflash_dist: {kind}: {e}", file=sys.stderr, flush=True)
        return 2
    except Stopped as e:
        print(f"dflash-train: stopped on {e} before the ranks started", file=sys.stderr, flush=True)
        return 128 + e.signum
    finally:
        relay.restore()


def _container(dcfg) -> dict:
    from omegaconf import OmegaConf
    return OmegaConf.to_container(dcfg, resolve=True)


if __name__ == "__main__":
    sys.exit(main())
