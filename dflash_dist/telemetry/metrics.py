"""Metrics: console, metrics.jsonl (always), wandb (online, offline or disabled) and a progress bar.

Only the leader (global rank 0, the first drafter) writes. wandb defaults to offline unless credentials
are configured: an online wandb with a key but no network hangs ~90 s at init.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time
from collections import deque
from typing import Optional

from dflash_dist.storage import writing

log = logging.getLogger("dflash_dist")


def wandb_mode(requested: Optional[str]) -> str:
    if requested:
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    has_key = bool(os.environ.get("WANDB_API_KEY"))
    netrc = os.path.expanduser("~/.netrc")
    if not has_key and os.path.exists(netrc):
        with open(netrc) as f:
            has_key = "api.wandb.ai" in f.read()
    return "online" if has_key else "offline"


# ----------------------------------------------------------------------------------------------- dashboard

# wandb sections (the part of a key before its first "/"): each reads as one dashboard panel group.
THROUGHPUT_KEYS = ("samples_per_s", "tokens_per_s", "link_gb_per_s", "epoch_progress",
                   "target_capacity_samples_per_s", "drafter_capacity_samples_per_s")
# acceptance_length (pooled, the headline) sorts first in its section: the dashboard's first acceptance chart
ACCEPTANCE_EVAL_KEYS = ("acceptance_length", "tau", "tau_pooled", "tau_stderr", "tau_all_prompts", "tau_from_train_acc",
                        "train_serve_gap", "train_acc", "n_prompts", "max_new_tokens", "prompts_one_step",
                        "prompts_in_tau")
_TARGET = re.compile(r"target(\d+)_(.+)")
_SLOT = re.compile(r"acc_slot_(\d+)")
# a variant whose proposals are not the head's argmax (DFlash2's selector, Domino's correction) logs their
# teacher-forced accuracy per slot as served_acc_slot_k: the training side of its train/serve comparison
_SERVED_SLOT = re.compile(r"served_acc_slot_(\d+)")
_POS = re.compile(r"accept_pos_(\d+)")
# define_metric summaries: (key, aggregations)
SUMMARIES = (("throughput/samples_per_s", "max,mean,last"), ("throughput/tokens_per_s", "max,mean"),
             ("throughput/link_gb_per_s", "max,mean"), ("train/loss", "min,last"),
             ("acceptance/acceptance_length", "max,last"), ("acceptance/tau", "max,last"),
             ("acceptance/tau_pooled", "max,last"))


def dashboard_key(kind: str, key: str) -> Optional[str]:
    """The wandb key of a metrics.jsonl value: ``throughput/`` (job samples/s, tokens/s, link GB/s, supply and
    demand capacity), ``target/`` (per target rank: ``rank<r>_tokens_per_s``, busy/wait fractions, MFU),
    ``drafter/`` (busy, stream wait, MFU, step time), ``train/`` (loss, lr, grad norm, accuracy),
    ``acceptance/`` (the pooled acceptance length, z-lab's tau, the tau training accuracy predicts), ``eval/`` (evaluation timings), other
    kinds under their kind. None: a per-position value, logged as one chart instead (:func:`position_values`)."""
    if "/" in key:
        return key
    if kind == "train":
        if key in THROUGHPUT_KEYS:
            return f"throughput/{key}"
        m = _TARGET.fullmatch(key)
        if m:
            return f"target/rank{m.group(1)}_{m.group(2)}"
        if key.startswith("drafter_"):
            return f"drafter/{key[len('drafter_'):]}"
        if _SLOT.fullmatch(key) or _SERVED_SLOT.fullmatch(key):
            return None
        if key == "tau_from_acc":
            return "acceptance/tau_from_train_acc"
        return f"train/{key}"
    if kind == "eval":
        if _POS.fullmatch(key):
            return None
        return f"acceptance/{key}" if key in ACCEPTANCE_EVAL_KEYS else f"eval/{key}"
    return f"{kind}/{key}"


def position_values(kind: str, values: dict) -> list:
    """[(block position k, value)] of a record: training accuracy per slot (of the proposals the variant serves
    where it logs them, ``served_acc_slot_k``; else the head's argmax), or measured acceptance per position."""
    pat = _SLOT if kind == "train" else _POS if kind == "eval" else None
    if kind == "train" and any(_SERVED_SLOT.fullmatch(k) for k in values):
        pat = _SERVED_SLOT
    if pat is None:
        return []
    out = [(int(m.group(1)), v) for k, v in values.items() for m in [pat.fullmatch(k)] if m and v is not None]
    return sorted(out)


def capacity_metrics(values: dict) -> dict:
    """Supply and demand of a training window in samples/s: what the targets would send if never blocked (each
    target's samples/s over its busy fraction, summed) and what the drafters would take if never starved
    (the job's samples/s over the drafters' busy fraction). The smaller side bounds the job."""
    out = {}
    supply = 0.0
    for k, v in values.items():
        m = _TARGET.fullmatch(k)
        if m and m.group(2) == "samples_per_s":
            busy = values.get(f"target{m.group(1)}_busy_frac")
            if v is not None and busy:
                supply += v / busy
    if supply:
        out["target_capacity_samples_per_s"] = supply
    busy = values.get("drafter_busy_frac")
    if values.get("samples_per_s") is not None and busy:
        out["drafter_capacity_samples_per_s"] = values["samples_per_s"] / busy
    return out


class MetricsWriter:
    def __init__(self, run_dir: str, config: dict, wandb_cfg, total_steps: int, enabled: bool,
                 progress_bar: bool = True):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.wandb = None
        self.bar = None
        self.total_steps = total_steps
        self.wandb_mode = "disabled"
        self.wandb_run_dir = None  # <run_dir>/wandb/<offline-run-...>: what `wandb sync` takes
        self._last_train = None        # (step, time) of the last train record: the drafter's step time
        self._positions: dict = {}     # name -> (step, [(position, value)]) last seen, charted at close
        self._train_windows = 0
        self.position_chart_every = 10  # training windows between per-position charts (each is a wandb Table)
        if not enabled:
            return
        with writing(self.path, "the run's metrics"):  # a full disk: one line naming the file and errno
            os.makedirs(run_dir, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
        mode = wandb_mode(wandb_cfg.mode)
        self.wandb_mode = mode
        if mode != "disabled":
            import wandb
            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb = wandb.init(project=wandb_cfg.project, entity=wandb_cfg.entity,
                                    name=wandb_cfg.name or os.path.basename(os.path.abspath(run_dir)),
                                    dir=run_dir, mode=mode, config=config, resume="allow",
                                    settings=wandb.Settings(init_timeout=30, console="off"))
            if self.wandb is not None:
                self.wandb_run_dir = os.path.dirname(os.path.normpath(self.wandb.dir))
            log.info("wandb: mode=%s dir=%s", mode, self.wandb_run_dir)
            for key, agg in SUMMARIES:
                self.wandb.define_metric(key, summary=agg)
        if progress_bar and sys.stderr.isatty():
            # On a terminal only (a log file or pipe gets a plain line per logged step instead). Log lines go
            # through tqdm.write (comm.distributed.setup_logging), so they never land on the bar.
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0)

    def log(self, step: int, values: dict, kind: str = "train") -> None:
        if not self.enabled:
            return
        now = time.time()
        if kind == "train":
            values = {**values, **capacity_metrics(values)}
            prev = self._last_train
            if prev is not None and step > prev[0]:  # the drafter's mean step time over the window
                values["drafter_step_time_s"] = (now - prev[1]) / (step - prev[0])
            self._last_train = (step, now)
        rec = {"step": step, "kind": kind, "time": now}
        rec.update({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in values.items()})
        with writing(self.path, "the run's metrics"):
            self._file.write(json.dumps(rec) + "\n")
        if self.wandb is not None:
            self._wandb_log(step, kind, values)

    def _wandb_log(self, step: int, kind: str, values: dict) -> None:
        out = {}
        for k, v in values.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            key = dashboard_key(kind, k)
            if key is not None:
                out[key] = v
        pos = position_values(kind, values)
        if pos:
            name = "train_acc_per_position" if kind == "train" else "per_position"
            self._positions[name] = (step, pos)
            if kind != "train" or self._train_windows % self.position_chart_every == 0:
                out[f"acceptance/{name}"] = self._position_chart(name, step, pos)
        if kind == "train":
            self._train_windows += 1
        if out:
            self.wandb.log(out, step=step)

    def _position_chart(self, name: str, step: int, pos: list):
        import wandb
        what = "training accuracy" if name.startswith("train") else "measured acceptance"
        table = wandb.Table(data=[[k, v] for k, v in pos], columns=["block_position", "acceptance"])
        return wandb.plot.line(table, "block_position", "acceptance",
                               title=f"{what} per block position (step {step})")

    def progress(self, step: int, postfix: dict) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.refresh()

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        self._file.close()
        if self.wandb is not None:
            last = self._positions.get("train_acc_per_position")
            if last is not None and (self._train_windows - 1) % self.position_chart_every != 0:
                self.wandb.log({"acceptance/train_acc_per_position": self._position_chart(
                    "train_acc_per_position", *last)}, step=last[0])
            self.wandb.finish()


def run_summary(*, stopped: bool, steps: int, steps_this_run: int, samples: int, wall_s: float,
                loss: Optional[float], tau: Optional[tuple], checkpoint: Optional[str], metrics_path: str,
                wandb_dir: Optional[str], wandb_mode: str, totals: Optional[dict] = None,
                launch: Optional[dict] = None, plan: Optional[str] = None, memory: Optional[str] = None,
                pace: Optional[str] = None) -> str:
    """The few lines a run ends with (leader): what it trained and where its results are; ``totals``: the run's
    sample totals over all its launches (``run_*`` keys of the accounting record) next to this ``launch``'s;
    ``plan``: the planned-vs-measured line of a job started from a plan (telemetry/plan_check.py); ``tau``: (step,
    pooled acceptance length, z-lab's per-prompt tau) of the last evaluation; ``memory``: a GPU run's peak memory
    next to its plan (telemetry/memory_peak.py); ``pace``: the steady steps' rate apart from the compiles and the
    startup the wall time includes (the drafter loop's ``pace_line``)."""
    def fmt(x, spec):
        return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)
    lines = [f"run {'stopped' if stopped else 'finished'}: {steps} steps"
             + (f" ({steps_this_run} in this launch)" if steps_this_run != steps else "")
             + f", {samples} samples in {wall_s:.1f} s ({samples / max(wall_s, 1e-9):.1f} samples/s), "
               f"final loss {fmt(loss, '.4f')}"
             + (f", acceptance length {fmt(tau[1], '.3f')} (pooled over verify steps; z-lab's tau "
                f"{fmt(tau[2] if len(tau) > 2 else None, '.3f')}) at step {tau[0]}" if tau
                else ", acceptance not evaluated")]
    if totals:
        n = int(totals["run_launches"])
        lines.append(f"  samples:    over the run's {n} launch{'es' if n != 1 else ''}: "
                     + ", ".join(f"{int(totals['run_samples_' + k])} {k.replace('_', ' ')}" for k in
                                 ("sent", "trained", "skipped", "dropped_after_stop", "repeated"))
                     + (f" (this launch: {int(launch['samples_sent'])} sent, {int(launch['samples_trained'])} "
                        f"trained)" if launch else ""))
    if plan:  # a job started from a plan: its prediction next to what the run measured
        lines.append(f"  {plan}")
    if memory:
        lines.append(f"  {memory}")
    if pace:
        lines.append(f"  {pace}")
    lines.append(f"  checkpoint: {checkpoint or 'none written'}")
    lines.append(f"  metrics:    {metrics_path}")
    if wandb_dir:
        lines.append(f"  wandb:      {wandb_dir}" + (f"   (offline: upload with `wandb sync {wandb_dir}`)"
                                                    if wandb_mode == "offline" else ""))
    return "\n".join(lines)


class RateMeter:
    """Samples/s and tokens/s over the last logging window."""

    def __init__(self):
        self.t0 = time.monotonic()
        self.samples = self.tokens = 0

    def add(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens

    def take(self) -> dict:
        dt = max(time.monotonic() - self.t0, 1e-9)
        out = {"samples_per_s": self.samples / dt, "tokens_per_s": self.tokens / dt, "window_s": dt}
        self.t0, self.samples, self.tokens = time.monotonic(), 0, 0
        return out


class _HostMark:
    """CPU stand-in for a CUDA timing event: on CPU the host is the compute stream."""

    def __init__(self):
        self.t = time.monotonic()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_HostMark") -> float:
        return (end.t - self.t) * 1e3


def _cuda_mark():
    import torch
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


class StreamWaitMeter:
    """How long the drafter's compute stream stood waiting in the receive of its messages.

    The host-side wait misses most of it on GPU: a payload receive only makes the stream wait (no host block), so a
    drafter starved by its targets reads busy on the host. A timing event before the receive completes when the
    previous step's work does, one after it when the stream may go on with the payload; their distance is the
    stream's wait (and the host's, if the host was later). Read without a sync: pairs are summed once complete.
    """

    def __init__(self, device):
        self._mark = _cuda_mark if getattr(device, "type", device) == "cuda" else _HostMark
        self._open: deque = deque()
        self._done_ms = 0.0

    def mark(self):
        return self._mark()

    def add(self, before, after) -> None:
        self._open.append((before, after))

    def seconds(self) -> float:
        """Total wait of the pairs complete so far (a pair still in flight counts in a later read)."""
        while self._open and self._open[0][1].query():
            before, after = self._open.popleft()
            self._done_ms += before.elapsed_time(after)
        return self._done_ms / 1e3


def target_window_metrics(now: dict, prev: dict, peak_tflops) -> dict:
    """Per-target-rank metrics of one logging window from the cumulative sender statistics that ride on every
    message header (transport.H_STATS: busy us, wait us (backpressure + compute-stream stall before a capture),
    tokens, samples, wall us, MFLOP, idle-work us).

    ``now``/``prev``: {rank: stats} at this and the previous window (prev may lack a rank: from its start).
    Everything is over the window: the sender's time between the two messages whose stamps arrived last (the
    first window counts from the rank's start, model load and first compile included). Cumulative fractions
    would keep a long first compile in the busy share for the whole of a short job."""
    out: dict = {}
    for src, st in now.items():
        if not st or len(st) < 5 or st[4] <= 0:
            continue
        p = prev.get(src) or [0] * len(st)
        dt = (st[4] - p[4]) / 1e6
        if dt <= 0:
            continue
        out[f"target{src}_busy_frac"] = (st[0] - p[0]) / 1e6 / dt
        out[f"target{src}_wait_frac"] = (st[1] - p[1]) / 1e6 / dt
        out[f"target{src}_tokens_per_s"] = (st[2] - p[2]) / dt
        out[f"target{src}_samples_per_s"] = (st[3] - p[3]) / dt
        if len(st) > 5 and peak_tflops:
            out[f"target{src}_mfu"] = (st[5] - p[5]) * 1e6 / dt / (peak_tflops * 1e12)
        if len(st) > 6:  # the share of the window it ran the in-training evaluation while waiting (not in wait)
            out[f"target{src}_eval_frac"] = (st[6] - p[6]) / 1e6 / dt
    return out
