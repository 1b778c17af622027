"""``train.*``: the optimizer, schedule, run directory, checkpoints and in-training evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from dflash_dist.config.base import _check_choices, _require, _sub


@dataclass
class TrainTuning:
    """Scheduling knobs of the training run; the defaults are the measured best."""

    eval_in_slices: bool = True
    """Run an in-training evaluation one verify step at a time while the target waits for its drafters to take
    messages (its idle time in a drafter-bound job), so it does not delay the features. An evaluation still running
    when the next one is due makes the leader skip that one (logged); the last one runs whole after the stream.
    Needs waits the target can poll (NCCL, or rendezvous sends); else, and with false, each evaluation runs whole
    between two messages and the drafters wait for it."""


@dataclass
class TrainConfig:
    output_dir: Optional[str] = None
    """Run directory: run.json (what the run belongs to: data, tokenizer, target, drafter, plan, by content),
    config.json (the resolved config), metrics.jsonl, checkpoints, wandb files. One run per directory. None: a new
    ``outputs/run-YYYYmmdd-HHMMSS`` under the current directory for every run (rank 0 picks it, every rank uses
    it). A directory that already holds a run is refused unless ``resume`` continues that run."""

    max_steps: int = -1
    """Train exactly this many optimizer steps, repeating the data as needed (more epochs in the plan); -1: run
    ``epochs`` over the data. A resume with a larger value extends the run (logged)."""

    epochs: int = 6
    """Passes over the training data (the paper's 6); used only when ``max_steps`` is -1. A resume with a larger
    value extends the run (logged)."""

    lr: float = 6e-4
    """Peak AdamW learning rate."""

    warmup_ratio: float = 0.04
    """Fraction of steps of linear warmup before the cosine decay."""

    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of lr."""

    weight_decay: float = 0.0
    """AdamW weight decay."""

    betas: list = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""

    grad_clip: float = 1.0
    """Global gradient-norm clip."""

    seed: int = 0
    """Seed for drafter init and anchor sampling (per rank: seed + rank)."""

    device: Literal["auto", "cuda", "cpu"] = "auto"
    """auto (cuda if available), cuda or cpu."""

    checkpoint_every: int = 0
    """Save resumable state every N steps (0: only at the end and on SIGTERM/SIGINT)."""

    keep_checkpoints: int = 2
    """How many step checkpoints to keep."""

    resume: str = "none"
    """none (a new run), auto (the newest complete checkpoint of ``output_dir``; without ``output_dir``, of the
    newest run under outputs/ with the same data, tokenizer, target and drafter), or a checkpoint directory.
    A checkpoint of other data, tokenizer, target, drafter shape or batching plan is refused before any model
    loads, naming what differs; one with nothing left to train ends the job at once (exit 0)."""

    eval_every: int = 0
    """Acceptance-length evaluation every N steps on the target ranks (0: only at the end if eval_prompts > 0)."""

    eval_prompts: int = 0
    """Held-out prompts per evaluation (0 disables in-training evaluation)."""

    eval_max_new_tokens: int = 128
    """Tokens generated per evaluation prompt; dflash-eval generates as many by default (the checkpoint's value)."""

    eval_batch_size: int = 1
    """Held-out prompts an evaluation decodes together, each as it would alone (as ``dflash-eval --batch-size``):
    one verify forward per step for the batch. Used where an evaluation runs whole (a colocated rank, or
    ``train.tuning.eval_in_slices=false``) and not on a target replica; elsewhere, one prompt at a time (logged).
    Needs a target whose layers are all full attention, with sdpa or eager attention."""

    eval_exclude_one_step: bool = True
    """Leave out of z-lab's tau (the mean over prompts of each prompt's mean acceptance length) the prompts whose
    generation ended inside their first block: accepted in one verify step, each adds a figure near the block size
    that says little about the drafter (counted as ``prompts_one_step``). The headline, ``acceptance_length``
    (pooled: all accepted+1 tokens / all verify steps), counts every step either way; dflash-eval's
    ``--include-one-step`` is the same setting."""

    memory_check: Literal["refuse", "warn", "off"] = "refuse"
    """Before any model loads, each rank's memory is planned from the config (dflash_dist/planning/memory.py:
    weights, optimizer state, capture buffers, the largest step's activations) and compared with the device: a
    GPU's memory per rank, on CPU the machine's available memory (a cgroup limit included) shared by all its
    ranks, and ``ulimit -v`` per process. ``refuse``: a plan over the limit is a configuration error naming the
    largest parts and the setting that shrinks them, within 10% of it a warning; ``warn``: a warning either way;
    ``off``: no check (dflash-doctor still prints the plan)."""

    max_nonfinite_steps: int = 3
    """Stop the job (exit code 3, no checkpoint) after this many optimizer steps in a row with a non-finite loss or
    gradient norm; checked at each logging window, and before each save (where one such step already stops it)."""

    tuning: TrainTuning = field(default_factory=TrainTuning)
    """Scheduling knobs (``train.tuning.*``)."""

    def __post_init__(self) -> None:
        _check_choices(self, "train")
        self.tuning = _sub(self.tuning, TrainTuning, "train.tuning")
        _require(self.max_steps == -1 or self.max_steps > 0, f"train.max_steps={self.max_steps}: -1 or > 0")
        _require(self.epochs >= 1, f"train.epochs={self.epochs}: must be >= 1")
        _require(self.lr > 0, "train.lr must be > 0")
        _require(0 <= self.warmup_ratio < 1, "train.warmup_ratio must be in [0, 1)")
        _require(self.grad_clip > 0, "train.grad_clip must be > 0")
        _require(self.checkpoint_every >= 0 and self.eval_every >= 0, "checkpoint_every/eval_every must be >= 0")
        _require(self.keep_checkpoints >= 1, "train.keep_checkpoints must be >= 1")
        _require(self.eval_batch_size >= 1, f"train.eval_batch_size={self.eval_batch_size}: must be >= 1")
        _require(self.max_nonfinite_steps >= 1, "train.max_nonfinite_steps must be >= 1")
        self.betas = _check_betas(self.betas)


def _check_betas(betas) -> list:
    """AdamW's two betas as floats, each in [0, 1) (a string, a bool or a non-number refused)."""
    ok = isinstance(betas, (list, tuple)) and len(betas) == 2 and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)
    _require(ok, f"train.betas={betas!r}: give two numbers in [0, 1), e.g. [0.9, 0.95]")
    return [float(b) for b in betas]
