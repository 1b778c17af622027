"""Typed configuration for dflash_dist: one module per Hydra group (``target``, ``drafter``, ``data``,
``topology``, ``train``, ``logs`` for ``logging``), the whole job in ``job``, the shared checks in ``base``.

Hydra composes the YAML tree in ``conf/``; ``JobConfig.from_omegaconf`` turns it into these dataclasses,
which validate themselves in ``__post_init__``. Checks that need the world size or the target's HF config
live in ``validate_job`` and run before any model is loaded, so a wrong run fails in seconds with a
message that says what to change.
"""

from dflash_dist.config.base import ConfigError, _check_choices, _require, _sub  # noqa: F401
from dflash_dist.config.data import DataConfig  # noqa: F401
from dflash_dist.config.drafter import (  # noqa: F401
    DrafterConfig,
    DrafterDFlash2,
    DrafterDomino,
    DrafterLoss,
    DrafterTuning,
    drafter_backend,
)
from dflash_dist.config.job import (  # noqa: F401
    GROUPS,
    JobConfig,
    check_overrides,
    check_split,
    split_targets,
    compose_config,
    default_layer_ids,
    group_defaults,
    register_config_groups,
    resolve_backend,
    resolve_device,
    resolve_layer_ids,
    validate_job,
)
from dflash_dist.config.logs import LoggingConfig, LoggingDebug, WandbConfig  # noqa: F401
from dflash_dist.config.target import TargetConfig, TargetTuning  # noqa: F401
from dflash_dist.config.topology import TopologyConfig, TopologyTuning  # noqa: F401
from dflash_dist.config.train import TrainConfig, TrainTuning  # noqa: F401
