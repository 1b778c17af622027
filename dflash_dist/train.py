"""Entry point: ``torchrun --nproc-per-node N -m dflash_dist.train [hydra overrides]``.

setup (config, ctrl group, validation, data plan, split -- measured with ``topology.target_ranks=auto`` --,
role groups) -> one role loop (target or drafter) -> teardown.
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

from dflash_dist.comm.lifecycle import Lifecycle
from dflash_dist.config import ConfigError, JobConfig
from dflash_dist.job import setup

log = logging.getLogger("dflash_dist")


def run(cfg: JobConfig) -> int:
    job = setup(cfg)
    topo = job.dist.topo
    job.life = Lifecycle(job.dist.store, topo.rank, topo.role, topo.world_size, topo.role_of)
    try:
        if topo.role == "target":
            from dflash_dist.target.loop import run_target
            run_target(job)
        else:
            from dflash_dist.drafter.loop import run_drafter
            run_drafter(job)
    except BaseException as e:
        root = job.life.root_cause(settle_s=0.0 if isinstance(e, (ConfigError, KeyboardInterrupt)) else 1.0)
        if root is not None and not root.startswith(f"rank {topo.rank} "):
            # a secondary error (a broken wait on a dead or failed peer): report the root cause once
            log.error("stopping without a checkpoint because %s (here: %s: %s)", root, type(e).__name__, str(e).splitlines()[0][:200])
            os._exit(1)
        job.life.report_failure(f"rank {topo.rank} ({topo.role}) failed: {type(e).__name__}: {e}")
        raise
    dist.barrier(group=job.dist.ctrl)
    dist.destroy_process_group()
    return 0


def _hydra_main():
    import hydra
    from omegaconf import DictConfig

    from dflash_dist.config import register_config_groups
    register_config_groups()  # each group's dataclass defaults as its `base` option (conf/ holds only presets)

    @hydra.main(config_path="conf", config_name="config", version_base=None)
    def entry(dcfg: DictConfig) -> None:
        try:
            run(JobConfig.from_omegaconf(dcfg))
        except ConfigError as e:  # before any model loads: say what to change, exit 2
            print(f"dflash_dist: configuration error: {e}", file=sys.stderr)
            if dist.is_initialized():  # NCCL tears down badly without it (a peer segfaulted at exit)
                dist.destroy_process_group()
            sys.exit(2)

    entry()


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
