"""Entry point of every rank: ``torchrun --nproc-per-node N -m dflash_dist.train [hydra overrides]`` (several
nodes, SLURM); on one machine ``dflash-train`` (``cli/train.py``) starts the ranks itself, and so does ``python -m
dflash_dist.train`` outside torchrun.

setup (config, ctrl group, validation, data plan, split -- measured with ``topology.target_ranks=auto`` --,
role groups) -> one role loop (target or drafter) -> teardown.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from dflash_dist.checkpoint.claim import release_claims
from dflash_dist.checkpoint.store import CheckpointError
from dflash_dist.comm.lifecycle import DIVERGED, STOPPED_AT_ONCE, Lifecycle, exit_code_for
from dflash_dist.config import ConfigError, JobConfig
from dflash_dist.data.conversations import DataError
from dflash_dist.job import setup
from dflash_dist.paths import CONF_DIR
from dflash_dist.role_jobs import role_view

log = logging.getLogger("dflash_dist")


KEY_USAGE_ERROR = "dflash/usage_error"
KEY_USAGE_ERROR_RANKS = "dflash/usage_error_ranks"
_ROLES_RUNNING = False  # set once setup is done: a later ConfigError is one rank's, the others do not wait for it


def quiet_profiler(cfg: JobConfig) -> None:
    """Kineto prints a ``USDT: ... profiler_start`` / ``profiler_stop`` line at every profiler window (the startup
    report profiles one step): silenced unless profiling was asked for (logging.debug.profile_step) or KINETO_LOG_LEVEL
    is set. Level 6 is above all of Kineto's levels (USDT is 5); it is read when the profiler starts."""
    if cfg.logging.debug.profile_step < 0:
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def run(cfg: JobConfig) -> int:
    quiet_profiler(cfg)
    job = setup(cfg)
    tell_launcher(job.run_dir)
    if job.nothing_left is not None:  # a finished run resumed: say so once, every rank exits 0 now
        if int(os.environ.get("RANK", "0")) == 0:
            log.info("%s", job.nothing_left)
        dist.barrier(group=job.ctrl)
        dist.destroy_process_group()
        return 0
    topo = job.dist.topo
    global _ROLES_RUNNING
    _ROLES_RUNNING = True  # from here a rank's error is reported through the Lifecycle (the others exit 1)
    job.life = Lifecycle(job.dist.store, topo.rank, topo.role, topo.world_size, topo.role_of)
    try:
        if topo.role == "target":
            from dflash_dist.roles.target_rank.loop import run_target
            run_target(role_view(job, "target"))
        elif topo.role == "colocated":
            from dflash_dist.roles.colocated import run_colocated
            run_colocated(job)
        else:
            from dflash_dist.roles.drafter_rank.loop import run_drafter
            run_drafter(role_view(job, "drafter"))
    except BaseException as e:
        if type(e).__name__ == DIVERGED:
            diverged_exit(job.life, e)
        if isinstance(e, KeyboardInterrupt) or job.life.stop_now or STOPPED_AT_ONCE in (job.life.failure() or ""):
            stop_at_once(job.life)
        root = job.life.root_cause(settle_s=0.0 if isinstance(e, ConfigError) else 1.0)
        if root is not None and STOPPED_AT_ONCE in root:
            stop_at_once(job.life)  # a peer's second signal, posted after this rank's wait broke
        if root is not None and not root.startswith(f"rank {topo.rank} "):
            # a secondary error (a broken wait on a dead or failed peer): report the root cause once
            if exit_code_for(root) == 3:  # said once by the drafters' leader
                diverged_exit(job.life, None)
            log.error("stopping without a checkpoint because %s (here: %s: %s)", root, type(e).__name__,
                      (str(e).splitlines() or [""])[0][:200])
            release_claims()
            os._exit(exit_code_for(root))
        job.life.report_failure(f"rank {topo.rank} ({topo.role}) failed: {type(e).__name__}: {e}")
        raise
    dist.barrier(group=job.dist.ctrl)
    dist.destroy_process_group()
    return 0


def diverged_exit(life: Lifecycle, e) -> None:
    """Training diverged (roles/drafter_rank/trainer.TrainingDiverged ``e``; None on a rank that learnt it from a peer): the
    drafters all find it at the same step; the leader says why in one line, every rank exits 3, no traceback."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(3))
    if e is not None:
        life.report_failure(f"rank {life.rank} ({life.role}) failed: {DIVERGED}: {e}")
        if life.rank == 0:
            print(f"dflash_dist: {e}", file=sys.stderr, flush=True)
    release_claims()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(3)


def stop_at_once(life: Lifecycle) -> None:
    """A second Ctrl-C / SIGINT (here or on a peer: its broken wait brought this rank here): no checkpoint and no
    traceback; rank 0 says so once, every rank exits 130."""
    life.report_failure(f"rank {life.rank} ({life.role}) {STOPPED_AT_ONCE}")
    if life.rank == 0:
        log.warning("%s: no checkpoint written", STOPPED_AT_ONCE)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


def _hydra_main():
    import hydra
    from omegaconf import DictConfig

    from dflash_dist.config import check_overrides, register_config_groups
    register_config_groups()  # each group's dataclass defaults as its `base` option (conf/ holds only presets)
    try:
        check_overrides(sys.argv[1:], CONF_DIR)
    except ConfigError as e:  # an unknown key or option: Hydra would print it on every rank and exit 1
        usage_error_exit(e)

    # absolute: a relative config_path is looked up as a package (dflash_dist.conf) when called from an installed
    # entry point, and conf/ is a directory, not a package
    @hydra.main(config_path=CONF_DIR, config_name="config", version_base=None)
    def entry(dcfg: DictConfig) -> None:
        try:
            run(JobConfig.from_omegaconf(dcfg))
        except (ConfigError, DataError, CheckpointError) as e:  # say what to change, once; exit 2
            usage_error_exit(e)

    entry()


def tell_launcher(run_dir: str) -> None:
    """Rank 0 names the run directory to ``dflash-train`` (the file in DFLASH_LAUNCH_INFO), which prints the
    command that continues the run after a stop signal."""
    path = os.environ.get("DFLASH_LAUNCH_INFO")
    if path and int(os.environ.get("RANK", "0")) == 0:
        from dflash_dist.storage import writing
        with writing(path, "the run directory's name for dflash-train"):
            with open(path + ".tmp", "w") as f:
                json.dump({"run_dir": run_dir}, f)
            os.replace(path + ".tmp", path)


def _first_to_report(text: str) -> bool:
    """One rank prints a configuration or data error: the first to post it in the rendezvous store (every rank
    usually has the same one); rank 0 when there is no process group yet."""
    rank = int(os.environ.get("RANK", "0"))
    if not dist.is_initialized():
        return rank == 0
    try:
        mine = f"{rank}\n{text}"
        return dist.distributed_c10d._get_default_store().compare_set(KEY_USAGE_ERROR, "", mine).decode() == mine
    except Exception:
        return rank == 0


def _wait_for_peers(timeout_s: float = 20.0) -> None:
    """Count this rank in and wait (bounded) until every rank has: torchrun SIGTERMs the other workers as soon as
    one exits, and a rank still on its way to the same error (slower imports) would die of that signal (-15)
    instead of exiting 2. A rank that never comes (another state) only delays the exit by ``timeout_s``."""
    try:
        if not dist.is_initialized():  # an error before the process group (the config itself): join one now
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        store, world = dist.distributed_c10d._get_default_store(), dist.get_world_size()
        store.add(KEY_USAGE_ERROR_RANKS, 1)
        deadline = time.monotonic() + timeout_s
        while store.add(KEY_USAGE_ERROR_RANKS, 0) < world and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:
        pass


def usage_error_exit(e: Exception) -> None:
    """Print a ConfigError/DataError once (no traceback), exit 2 on every rank (they all raise it: the checks are
    the same everywhere, rank 0's data preparation hands its errors to every rank). A SIGTERM from here on (torchrun
    stopping the group once a worker exited) exits 2 as well."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
    release_claims()
    kind = getattr(e, "kind", None) or ("configuration error" if isinstance(e, ConfigError) else "data error"
                                        if isinstance(e, DataError) else "checkpoint error")
    if "RANK" in os.environ and not _ROLES_RUNNING:
        _wait_for_peers()
    if _first_to_report(str(e)):
        print(f"dflash_dist: {kind}: {e}", file=sys.stderr, flush=True)
    if dist.is_initialized():  # NCCL tears down badly without it (a peer segfaulted at exit)
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)


def main() -> None:
    if "RANK" not in os.environ:  # not a rank of torchrun's: start the ranks, as dflash-train does
        from dflash_dist.cli.train import main as launch
        sys.exit(launch())
    _hydra_main()


if __name__ == "__main__":
    main()
