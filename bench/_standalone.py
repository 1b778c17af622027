"""A drafter rank without the pipeline, for bench/pipeline.py (drafter alone, synthetic features),
bench/experiments/threaded_baseline.py (features from a target thread) and bench/experiments/compile_race.py.

The job, the trainer and the messages come from ``tests/helpers/standalone_drafter.py`` (the same harness the
tests train with; re-exported here): the real ``DrafterTrainer`` on the job ``python -m dflash_dist.train`` would
run, fed messages of the sizes the transport delivers. Here: the per-step bookkeeping of the drafter loop
(``WindowMeter``) and the rate of a real run from its metrics (``parse_metrics``).
"""

from __future__ import annotations

import json
import os
import sys
import time

import _common as C
import torch
import torch.distributed as dist

if os.path.join(C.REPO, "tests") not in sys.path:
    sys.path.insert(0, os.path.join(C.REPO, "tests"))
from helpers.standalone_drafter import (  # noqa: E402,F401  (re-exported for the bench scripts)
    compose_job_config,
    init_single_process_group,
    job_overrides,
    make_job,
    make_message,
    make_trainer,
    message_tokens,
    my_messages,
)


class WindowMeter:
    """Step bookkeeping as run_drafter does it: read_window every log_every steps (an all-reduce and a host
    read, i.e. a sync), and the time and samples of each window."""

    def __init__(self, trainer, log_every: int, device: torch.device):
        self.trainer, self.log_every, self.device = trainer, log_every, device
        self.windows: list[dict] = []
        self.t_last = time.monotonic()
        self.samples = self.tokens = 0
        self.step_times: list[float] = []
        self.t0 = time.monotonic()
        self.cpu_group = dist.new_group(backend="gloo")

    def after_step(self, step: int, samples: int, tokens: int, last: bool, t_step: float) -> None:
        self.samples += samples
        self.tokens += tokens
        self.step_times.append(t_step)
        vote = torch.tensor([0.0])
        dist.all_reduce(vote, group=self.cpu_group)  # the per-step graceful-stop vote (gloo, host side)
        if step % self.log_every == 0 or last:
            w = self.trainer.read_window()
            now = time.monotonic()
            self.windows.append({"step": step, "t": now - self.t0, "dt": now - self.t_last, "samples": self.samples,
                                 "tokens": self.tokens, "samples_per_s": self.samples / max(now - self.t_last, 1e-9),
                                 "loss": w.get("loss")})
            self.t_last, self.samples, self.tokens = now, 0, 0

    def rate_after(self, warmup_steps: int) -> dict:
        ws = [w for w in self.windows if w["step"] - self.log_every >= warmup_steps]
        if not ws:
            return {"samples_per_s": None, "tokens_per_s": None, "steps_measured": 0}
        t = sum(w["dt"] for w in ws)
        return {"samples_per_s": sum(w["samples"] for w in ws) / t, "tokens_per_s": sum(w["tokens"] for w in ws) / t,
                "steps_measured": ws[-1]["step"] - ws[0]["step"] + self.log_every, "seconds_measured": t,
                "from_step": ws[0]["step"] - self.log_every, "to_step": ws[-1]["step"]}


def parse_metrics(path: str, warmup_steps: int) -> dict:
    """Samples/s of a real run from metrics.jsonl: windows that start at or after ``warmup_steps``, weighted by
    their duration (consecutive records' wall-clock times)."""
    if not os.path.exists(path):
        return {"samples_per_s": None, "error": f"no {path}"}
    recs = []
    with open(path) as f:
        for line in f:
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    train = [r for r in recs if r.get("kind") == "train"]
    windows = []
    for prev, cur in zip(train, train[1:]):
        dt = cur["time"] - prev["time"]
        windows.append({"from_step": prev["step"], "step": cur["step"], "dt": dt,
                        "samples_per_s": cur.get("samples_per_s"), "samples": (cur.get("samples_per_s") or 0) * dt,
                        "tokens": (cur.get("tokens_per_s") or 0) * dt})
    ws = [w for w in windows if w["from_step"] >= warmup_steps]
    out = {"records": len(train), "last_step": train[-1]["step"] if train else 0, "windows": windows,
           "last_record": train[-1] if train else None,
           "accounting": next((r for r in recs if r.get("kind") == "accounting"), None)}
    if ws:
        t = sum(w["dt"] for w in ws)
        out.update({"samples_per_s": sum(w["samples"] for w in ws) / t, "tokens_per_s": sum(w["tokens"] for w in ws) / t,
                    "seconds_measured": t, "from_step": ws[0]["from_step"], "to_step": ws[-1]["step"]})
    else:
        out["samples_per_s"] = None
    return out
