"""The whole job's config (``JobConfig``: one dataclass per Hydra group), composing it from ``conf/`` and the checks that need the world size or the target's config."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional

from dflash_dist.config.base import ConfigError, _require
from dflash_dist.config.data import DataConfig
from dflash_dist.config.drafter import DrafterConfig, drafter_backend
from dflash_dist.config.logs import LoggingConfig
from dflash_dist.config.target import TargetConfig
from dflash_dist.config.topology import TopologyConfig
from dflash_dist.config.train import TrainConfig


@dataclass
class JobConfig:
    target: TargetConfig
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @staticmethod
    def from_dict(d: dict) -> "JobConfig":
        known = {f.name for f in dataclasses.fields(JobConfig)}
        unknown = set(d) - known - {"hydra"}
        _require(not unknown, f"unknown config groups {sorted(unknown)}; known: {sorted(known)}")
        parts = {}
        for name, cls in GROUPS.items():
            section = dict(d.get(name) or {})
            names = {f.name for f in dataclasses.fields(cls)}
            bad = set(section) - names
            _require(not bad, f"unknown keys {sorted(bad)} in '{name}'; known: {sorted(names)}")
            parts[name] = cls(**section)
        return JobConfig(**parts)

    @staticmethod
    def from_omegaconf(cfg) -> "JobConfig":
        from omegaconf import OmegaConf
        return JobConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


GROUPS = {"target": TargetConfig, "drafter": DrafterConfig, "data": DataConfig, "topology": TopologyConfig,
          "train": TrainConfig, "logging": LoggingConfig}


def group_defaults(cls) -> dict:
    """A config dataclass's field defaults as a plain dict (sub-groups nested), without validating them."""
    out = {}
    for f in dataclasses.fields(cls):
        v = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out[f.name] = dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
    return out


def register_config_groups() -> None:
    """Each group's dataclass defaults become its ``base`` option in Hydra's ConfigStore: the YAML presets in
    ``conf/`` list ``base`` first and hold only what they change, so every default lives in the dataclasses of dflash_dist/config/ alone."""
    from hydra.core.config_store import ConfigStore
    cs = ConfigStore.instance()
    for group, cls in GROUPS.items():
        cs.store(group=group, name="base", node=group_defaults(cls))


def compose_config(overrides: list[str], conf_dir: str):
    """The job's Hydra config (the ``DictConfig``) from ``conf_dir`` and command-line style overrides, outside
    ``@hydra.main`` (dflash-plan, dflash-doctor, benchmarks)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    register_config_groups()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=os.path.abspath(conf_dir), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def check_overrides(args: list[str], conf_dir: str) -> None:
    """Compose the job's config from the command line once, before ``@hydra.main`` does: an unknown key or
    group option, or an override Hydra cannot parse, becomes a ``ConfigError`` (printed once by one rank, exit 2)
    instead of Hydra's message and exit 1 on every rank. ``hydra.*`` overrides take part (``hydra.searchpath``
    adds config directories); Hydra's own flags (``--help``, ``--cfg``, ``-m``) are left to Hydra."""
    if any(a.startswith("-") for a in args):
        return
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    try:
        compose_config(list(args), conf_dir)
    except (HydraException, OmegaConfBaseException) as e:
        msg = str(e).split("\nConfig search path:")[0].strip()
        key = getattr(e.__cause__, "full_key", None)
        if key and "not in struct" in str(e.__cause__):  # Hydra's hint (append with +key) would not help here
            parent, _, _leaf = key.rpartition(".")
            node = {g: group_defaults(c) for g, c in GROUPS.items()}
            for part in parent.split(".") if parent else ():
                node = node.get(part) if isinstance(node, dict) else None
            known = "" if not isinstance(node, dict) else \
                f"; known in '{parent}': {sorted(node)}" if parent else f"; the groups: {sorted(node)}"
            raise ConfigError(f"unknown key '{key}'{known}") from None
        cause = e.__cause__
        while cause is not None and not str(cause).strip():
            cause = cause.__cause__
        if cause is not None:
            first = str(cause).strip().splitlines()[0]
            if first and first not in msg:
                msg += f" ({first})"
        raise ConfigError(msg) from None


def default_layer_ids(num_target_layers: int, n: int = 5) -> list[int]:
    """DFlash's default feature layers: round(1 + k*(L-4)/(n-1)), k=0..n-1 (Qwen3-8B, L=36: [1,9,17,25,33]).
    A target too shallow for n distinct ids by that rule (L < n+3) gets min(n, L-1) ids spread evenly over
    0..L-2. Never the last layer L-1 (vLLM does not capture its output); [] for a 1-layer target."""
    n_layers = num_target_layers
    if n == 1:
        return [n_layers // 2] if n_layers >= 3 else [0] * (n_layers == 2)
    ids = [int(round(1 + k * (n_layers - 4) / (n - 1))) for k in range(n)]
    if n_layers >= 4 and len(set(ids)) == n:
        return ids
    m = min(n, n_layers - 1)  # distinct ids below the last layer: 0..L-2
    if m <= 1:
        return [0] * m
    return [int(round(k * (n_layers - 2) / (m - 1))) for k in range(m)]  # steps >= 1: distinct after rounding


def resolve_layer_ids(cfg: JobConfig, num_target_layers: int) -> list[int]:
    """``target.layer_ids`` or the default for this depth, refused when a layer id is out of range or the last
    layer (whose output vLLM never captures: the served drafter would get other features than it trained on)."""
    n_layers, explicit = num_target_layers, cfg.target.layer_ids
    layer_ids = list(explicit) if explicit else default_layer_ids(n_layers, cfg.target.num_feature_layers)
    _require(bool(layer_ids), f"a {n_layers}-layer target has no layer below its last one to feed the drafter "
                              "(vLLM never captures the last layer's output): use a target with at least 2 layers")
    bad = [i for i in layer_ids if not 0 <= i < n_layers]
    _require(not bad, f"target.layer_ids {bad} out of range for a target with {n_layers} decoder layers "
                      f"(valid: 0..{n_layers - 2}; id i = output of decoder layer i)")
    if n_layers - 1 in layer_ids:
        fix = default_layer_ids(n_layers, len(layer_ids))
        raise ConfigError(f"target.layer_ids={layer_ids} holds {n_layers - 1}, the last decoder layer of this "
                          f"{n_layers}-layer target: vLLM never captures its output, so the served drafter would "
                          f"get other features than it trained on. Use ids below {n_layers - 1}, e.g. "
                          f"target.layer_ids=[{','.join(map(str, fix))}], or leave target.layer_ids unset")
    return layer_ids


def split_targets(cfg: JobConfig, world_size: int):
    """The number of target ranks of the job (0: colocated), or ``auto``. One process can only be colocated: there
    ``topology.target_ranks`` (default 1) and ``auto`` mean that."""
    t = cfg.topology.target_ranks
    if world_size == 1 and (t == 1 or (t == "auto" and not cfg.topology.plan)) and cfg.target.tensor_parallel == 1:
        return 0
    return t if t == "auto" else int(t)


def check_split(cfg: JobConfig, world_size: int) -> None:
    """``topology.target_ranks`` leaves at least one drafter in a world of ``world_size`` ranks and forms whole
    replicas of ``target.tensor_parallel`` ranks, or is colocated (the one place of these rules: the job's setup and
    its full validation both ask it before any topology is built; ``comm.topology.Topology`` only asserts them)."""
    t, k = split_targets(cfg, world_size), cfg.target.tensor_parallel
    if t == 0:
        _require(k == 1, f"topology.target_ranks=0 (colocated) keeps a whole target on every rank, so it needs "
                         f"target.tensor_parallel=1 (got {k}): use topology.target_ranks={k} or more with "
                         f"{k + 1}+ processes")
    elif t != "auto":
        _require(t < world_size,
                 f"topology.target_ranks={t} leaves no drafter rank in a world of {world_size}: "
                 f"set topology.target_ranks=0 (colocated: every rank captures and trains)"
                 + (f" or at most {world_size - 1}" if world_size > 1 else "") + ", or start more processes")
        _require(t % k == 0, f"topology.target_ranks={t} is not a multiple of target.tensor_parallel={k}: "
                             f"the target ranks form replicas of {k} ranks (use {max(k, t - t % k)})")
    else:
        _require(world_size >= 2 or k == 1, f"topology.target_ranks=auto with target.tensor_parallel={k} needs "
                                            f"more than {k} processes, got a world of {world_size}")


def validate_job(cfg: JobConfig, world_size: Optional[int], num_target_layers: int, vocab_size: int,
                 mask_token_id: int) -> list[int]:
    """Checks that need the world size and the target's config. Returns the resolved layer ids.
    ``world_size`` None (dflash-plan: no job yet) skips the checks of the split."""
    if world_size is not None:
        check_split(cfg, world_size)
    _require(not (cfg.drafter.tuning.loss_on_target and cfg.topology.tuning.rendezvous_sends is False),
             "drafter.loss_on_target needs rendezvous sends (a target serves head requests while it waits for its "
             "drafters): remove topology.tuning.rendezvous_sends=false")
    layer_ids = resolve_layer_ids(cfg, num_target_layers)
    _require(0 <= mask_token_id < vocab_size,
             f"drafter.mask_token_id={mask_token_id} is outside the target vocabulary (size {vocab_size})")
    _require(cfg.drafter.num_anchors * cfg.drafter.block_size <= 1 << 20,
             "drafter.num_anchors * drafter.block_size is unreasonably large (> 1M query rows)")
    if cfg.train.device == "cpu":
        drafter_backend(cfg.drafter, "cpu")  # flex cannot train on CPU: the backend's own rule
    return layer_ids


def resolve_device(cfg: JobConfig) -> str:
    import torch
    if cfg.train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible: use train.device=cpu or auto")
    return cfg.train.device


def resolve_backend(cfg: JobConfig, device: str) -> str:
    return drafter_backend(cfg.drafter, device)
