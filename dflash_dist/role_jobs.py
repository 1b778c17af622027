"""What each role loop reads of the job: ``TargetJob`` for a target rank, ``DrafterJob`` for a drafter rank.

``job.setup`` builds the whole ``Job`` (config, data, plan, resume point, split); ``train.run`` hands each role
only its frozen view, so a role's inputs are listed in one place and a role cannot change the job. Below both
roles: neither imports the other, nor the setup.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

from dflash_dist.comm.distributed import Dist
from dflash_dist.config import JobConfig


@dataclass(frozen=True)
class RoleJob:
    """What both role loops read of the job (frozen: a role never changes the job)."""
    cfg: JobConfig
    """The validated config: each role reads its own group and the shared ones (topology timeouts, logging)."""
    dist: Dist
    """This rank's place in the split and its process groups."""
    life: object
    """comm.lifecycle.Lifecycle: signals, the graceful-stop agreement, failure reports."""
    run_dir: str
    """The run directory (checkpoints, metrics, traces)."""
    hf_config: object
    """The target's HF config (its text model's sizes, RoPE, vocabulary)."""
    drafter: object
    """model.spec.DrafterSpec: the drafter resolved once for the job (shape, block size, backend, compile flags,
    variant, objective settings); the target serves its objective with drafter.tuning.loss_on_target."""
    layer_ids: list
    """The target layers whose outputs the drafter is conditioned on."""
    mask_token_id: int
    """The token id of the MASK slots of a block."""
    tokenizer_path: str
    """The target's tokenizer (evaluation prompts, the checkpoint's metadata)."""
    holdout_path: str
    """The held-out conversations (in-training evaluation)."""
    plan: list
    """The batching plan: sample ids of every message of the run."""
    total_messages: int
    """Messages this training run covers in total."""
    start_cursor: int
    """Messages already trained (resume)."""
    start_step: int
    """Optimizer steps already taken (resume)."""
    local: object = field(default=None, kw_only=True)
    """comm.local.LocalLink on a colocated rank: its two halves' in-process link (messages, the target's embedding
    and lm_head, evaluation weights); None: a rank of one role, over the network."""


@dataclass(frozen=True)
class TargetJob(RoleJob):
    """A target rank's view: the tokenized data it captures features of."""
    dataset_path: str
    """The tokenized training data (data_cache/train-<key>.pt)."""


@dataclass(frozen=True)
class DrafterJob(RoleJob):
    """A drafter rank's view: where it resumes from and what its checkpoints record."""
    resume_from: Optional[str]
    """The checkpoint resumed from (None: a new run)."""
    sample_lengths: Optional[list]
    """The token length of every sample: the plan's batch shapes for the compile guard and precompile."""
    identity: dict
    """What the run belongs to (checkpoint.identity), recorded in every checkpoint."""
    auto_split: Optional[dict]
    """topology.target_ranks=auto: the measured rates and the chosen split (the planned rate it is checked against)."""
    plan_record: Optional[dict]
    """The split's ``kind: plan`` metrics record, built by the job with the split; the loop logs it once."""


def role_view(job, role: str, local=None) -> RoleJob:
    """The ``TargetJob`` or ``DrafterJob`` of a ``job.Job`` for a rank of ``role``; ``local``: the in-process link
    of a colocated rank, shared by its two views."""
    cls = TargetJob if role == "target" else DrafterJob
    return cls(**{f.name: getattr(job, f.name) for f in fields(cls) if f.name != "local"}, local=local)
