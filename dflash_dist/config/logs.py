"""``logging.*``: metrics, wandb, the progress line and the debugging switches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from dflash_dist.config.base import _check_choices, _require, _sub


@dataclass
class WandbConfig:
    mode: Optional[Literal["online", "offline", "disabled"]] = None
    """online, offline or disabled. None: online only if credentials are configured, else offline
    (never wait ~90 s on a network that is not there)."""

    project: str = "dflash_dist"
    """wandb project."""

    entity: Optional[str] = None
    """wandb entity (team)."""

    name: Optional[str] = None
    """Run name; None: the output directory's name."""

    def __post_init__(self) -> None:
        _check_choices(self, "logging.wandb")


@dataclass
class LoggingDebug:
    """Audits, traces and profiles for finding out why a run is slow or wrong; all off by default."""

    record_sample_ids: bool = False
    """Append the sample ids of every trained message to <output_dir>/sample_log/rank<r>.jsonl (audits and
    tests of the no-loss/no-repeat guarantee; costs a host sync per step on GPU)."""

    trace_target: bool = False
    """Each target rank appends one line per message to <output_dir>/target_trace/rank<r>.jsonl: samples,
    tokens, and where its time went (stream stall before the capture, the capture itself, backpressure wait
    before the send), for finding which side of the pipeline is slow and why (``dflash-report RUN_DIR`` summarises
    it)."""

    profile_step: int = -1
    """Drafter ranks train this step (0-based, counted in this run) under torch.profiler, write its Chrome trace
    to <output_dir>/profile/drafter_rank<r>_step<N>.json and log its phase timeline: each anchor group's forward,
    its loss or head request, each group's backward (waiting for its head reply), optimizer
    (``dflash-report RUN_DIR`` prints the written traces). The device is synchronized around that step. Target
    ranks trace their first message for that step the same way (target_rank<r>_step<N>.json: capture, send, the
    drafter taking it), after their earlier sends are taken (target.loop.MessageTrace says why). -1: off."""

    def __post_init__(self) -> None:
        _require(self.profile_step == -1 or self.profile_step >= 4,
                 f"logging.debug.profile_step={self.profile_step}: use -1 (off) or a step >= 4 (steps 0-3 compile, "
                 "run the startup report's profile and the host-sync check)")


@dataclass
class LoggingConfig:
    log_every: int = 10
    """Log metrics every N steps (console, metrics.jsonl, wandb)."""

    progress_bar: bool = True
    """Rank 0 shows a progress bar with samples/s and ETA when its stderr is a terminal (else, and with false, one
    log line per logged step)."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases settings."""

    peak_tflops: Optional[float] = None
    """bf16 peak of one GPU (TFLOP/s) for the MFU metrics (drafter_mfu, target<r>_mfu). None: the vendor figure
    for known GPUs (H100/H200 989.4, A100 312, ...); no MFU on CPU or unknown devices. Set it to a measured
    matmul rate to report MFU against that instead. An FP8 target's target<r>_mfu counts against the FP8 peak
    (the vendor figure, H100/H200 1978.9; or twice this value when set)."""

    debug: LoggingDebug = field(default_factory=LoggingDebug)
    """Audits, traces and profiles (``logging.debug.*``); all off by default."""

    def __post_init__(self) -> None:
        self.wandb = _sub(self.wandb, WandbConfig, "logging.wandb")
        self.debug = _sub(self.debug, LoggingDebug, "logging.debug")
        _require(self.log_every >= 1, "logging.log_every must be >= 1")
        _require(self.peak_tflops is None or self.peak_tflops > 0, "logging.peak_tflops must be > 0 (or null)")
