"""Which run directory a job writes to and where it resumes from (rank 0), the run's files, the resume point's
checks and the run's totals over all its launches.

Rank 0 claims the run directory (checkpoint.claim) before it looks into it or writes to it: two jobs on one
``train.output_dir`` can never both decide "new run" and mix their files; the second is refused naming the first.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import sys
import time
from typing import Optional

from dflash_dist.checkpoint.claim import claim_run_dir
from dflash_dist.checkpoint.identity import differences, read_run_json, run_markers, write_run_json
from dflash_dist.checkpoint.store import (
    CheckpointError,
    checkpoint_bytes,
    find_latest,
    remove_stale_tmp,
    space_problem,
    usable_problem,
)
from dflash_dist.config import ConfigError

log = logging.getLogger("dflash_dist")


def new_run_dir(root: str = "outputs") -> str:
    """outputs/run-YYYYmmdd-HHMMSS (-2, -3... if taken), relative to the current directory."""
    base = os.path.join(root, time.strftime("run-%Y%m%d-%H%M%S"))
    path, k = base, 1
    while os.path.exists(path):
        k += 1
        path = f"{base}-{k}"
    return path


def checkpoint_run_dir(path: str) -> Optional[str]:
    """<run>/checkpoints/step_N -> <run>."""
    parent = os.path.dirname(os.path.normpath(path))
    return os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else None


def newest_matching_run(identity: dict, root: str = "outputs") -> Optional[str]:
    if not os.path.isdir(root):
        return None
    for name in sorted(os.listdir(root), reverse=True):
        d = os.path.join(root, name)
        rec = read_run_json(d)
        if rec is not None and not differences(rec.get("identity"), identity):
            return d
    return None


def read_meta(path: str) -> dict:
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def new_run_hint(run_dir: str) -> str:
    return (f"To start a new run: leave train.output_dir unset (each run gets its own outputs/run-<date>-<time>) or "
            f"set another one, with train.resume=none. To continue the run in {run_dir}: use its settings "
            f"({os.path.join(run_dir, 'config.json')}) with train.output_dir={run_dir} train.resume=auto.")


def _explicit_checkpoint(cfg) -> Optional[str]:
    resume = cfg.train.resume if cfg.train.resume not in ("", None) else "none"
    ckpt_path = None if resume in ("none", "auto") else resume
    if ckpt_path is not None:
        if not os.path.isdir(ckpt_path):
            raise ConfigError(f"train.resume={ckpt_path}: no such checkpoint directory (use auto, none or a "
                              f"<run>/checkpoints/step_N directory)")
        problem = usable_problem(ckpt_path)
        if problem:
            raise CheckpointError(f"{problem} (train.resume={ckpt_path})")
    return ckpt_path


def choose_run_dir(cfg, identity: dict) -> tuple[str, bool]:
    """(the run directory, whether it is a new one this job named itself: outputs/run-<date>-<time>)."""
    t, ckpt_path = cfg.train, _explicit_checkpoint(cfg)
    if t.output_dir:
        return t.output_dir, False
    if ckpt_path is not None and checkpoint_run_dir(ckpt_path):
        return checkpoint_run_dir(ckpt_path), False
    if t.resume == "auto":
        found = newest_matching_run(identity)
        if found is not None:
            return found, False
        log.info("train.resume=auto: no earlier run of this data, target and drafter under outputs/: "
                 "starting a new run")
    return new_run_dir(), True


def resolve_run(cfg, identity: dict) -> dict:
    """Rank 0: the run directory and the checkpoint to resume (None: a fresh start), or a ConfigError that names
    the directory, what differs and what to set. Nothing is written here. ``identity``: this job's parts except
    the plan (known only once the data is tokenized)."""
    resume = cfg.train.resume if cfg.train.resume not in ("", None) else "none"
    ckpt_path = _explicit_checkpoint(cfg)
    run_dir = choose_run_dir(cfg, identity)[0]
    markers = run_markers(run_dir)
    recorded = (read_run_json(run_dir) or {}).get("identity")
    latest = find_latest(run_dir) if resume == "auto" else None
    if recorded is None and latest is not None:
        recorded = read_meta(latest).get("identity")
    if markers and (resume == "none" or recorded is None or differences(recorded, identity)):
        if resume == "none":
            why = "a new run (train.resume=none) would mix its files with that run's"
        else:
            why = "this job cannot continue it:\n  - " + "\n  - ".join(differences(recorded, identity))
        raise ConfigError(f"train.output_dir={run_dir} already holds a run ({', '.join(markers)}); {why}.\n"
                          + new_run_hint(run_dir))
    resume_from = ckpt_path or latest
    if resume_from is not None:
        diffs = differences(read_meta(resume_from).get("identity"), identity)
        if diffs:
            raise ConfigError(f"train.resume: checkpoint {resume_from} (run {run_dir}) cannot be continued by this job:"
                              f"\n  - " + "\n  - ".join(diffs) + "\n" + new_run_hint(run_dir))
    elif resume == "auto" and markers:
        log.warning("train.resume=auto: %s has no complete checkpoint: this run starts again from step 0 there",
                    run_dir)
    return {"run_dir": run_dir, "resume_from": resume_from}


def claim_and_resolve(cfg, identity: dict) -> dict:
    """Rank 0 of a training job: claim the run directory (a second job on it is refused naming the holder), then
    decide under the claim what resolve_run decides, and remove what unfinished saves left there. A directory this
    job named itself that another job took in the same second: the next name."""
    for _ in range(20):
        run_dir, named_here = choose_run_dir(cfg, identity)
        try:
            claim = claim_run_dir(run_dir)
        except ConfigError:
            if named_here:
                continue
            raise
        try:
            pinned = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=run_dir))
            run = resolve_run(pinned, identity)
        except BaseException:
            claim.release()
            raise
        for path in remove_stale_tmp(run_dir):
            log.warning("removed %s: what a save that never finished left behind", path)
        if run["resume_from"] is not None:  # at the start, not at the failing write
            problem = space_problem(run_dir, checkpoint_bytes(run["resume_from"]))
            if problem:
                log.warning("run directory %s: %s", run_dir, problem)
        return run
    raise ConfigError("train.output_dir: no free outputs/run-<date>-<time> directory; set train.output_dir")


def check_resume_point(meta: dict, path: str) -> None:
    """The checkpoint's position in the run: a cursor, step or total that is not a whole number in range would
    skip or repeat samples. Raises CheckpointError naming the file and the field."""
    file = os.path.join(path, "meta.json")

    def field(name: str) -> int:
        v = meta.get(name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise CheckpointError(f"{file}: field {name} is {v!r}, not a whole number: this checkpoint was not "
                                  f"written by dflash_dist or was edited; resume from another one (train.resume=)")
        return v

    total, cursor, step = field("total_messages"), field("cursor"), field("step")
    for name, v, lo, hi, what in (("total_messages", total, 1, None, "at least 1"),
                                  ("cursor", cursor, 0, total, f"0..{total} (total_messages)"),
                                  ("step", step, 0, cursor, f"0..{cursor} (each step trains at least one message)")):
        if v < lo or (hi is not None and v > hi):
            raise CheckpointError(f"{file}: field {name}={v} is outside the run's plan ({what}): resuming there "
                                  f"would skip or repeat samples; resume from another checkpoint (train.resume=)")


def write_run_files(job) -> None:
    """Rank 0: run.json (what the run belongs to) and config.json (this launch's resolved config; a resume keeps
    the earlier launch's as config.before-step<N>.json). A full disk: one StorageError line naming the file."""
    from dflash_dist.storage import writing
    d = job.run_dir
    with writing(os.path.join(d, "run.json"), "the run's record"):
        os.makedirs(d, exist_ok=True)
        run = {"created": time.strftime("%Y-%m-%d %H:%M:%S")} if job.resume_from is None \
            else dict(read_run_json(d) or {}, resumed=time.strftime("%Y-%m-%d %H:%M:%S"))
        run["messages_per_epoch"] = job.epoch_messages
        write_run_json(d, job.identity, run)
    path = os.path.join(d, "config.json")
    with writing(path, "the launch's resolved config"):
        if job.resume_from is not None and os.path.exists(path):
            os.replace(path, os.path.join(d, f"config.before-step{job.start_step}.json"))
        with open(path, "w") as f:
            json.dump(job.cfg.to_dict(), f, indent=1)


def resume_command(run_dir: str) -> str:
    """The command line that continues this run: this launch's arguments with its directory and resume=auto."""
    args = [a for a in sys.argv[1:] if not a.startswith(("train.resume=", "train.output_dir="))]
    nproc = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    nodes = int(os.environ.get("WORLD_SIZE", nproc)) // max(int(nproc), 1)
    launcher = f"torchrun --nproc-per-node {nproc}" + (f" --nnodes {nodes} <rendezvous options>" if nodes > 1 else "")
    return " ".join([launcher, "-m dflash_dist.train", *map(shlex.quote, args),
                     shlex.quote(f"train.output_dir={os.path.abspath(run_dir)}"), "train.resume=auto"])


# ---------------------------------------------------------------- the run's totals over all its launches
DROPPED_KEY = "dropped_after_checkpoint"  # run.json: samples a stopped launch dropped after its last checkpoint


def plan_samples(plan: list, cursor: int) -> int:
    """Samples of the plan's first ``cursor`` messages."""
    return sum(len(m) for m in plan[:cursor])


def earlier_totals(meta: Optional[dict], resume_from: Optional[str], run_dir: str, plan: list) -> dict:
    """The run's totals before this launch: those of the checkpoint resumed from (through its cursor) and what
    the launch that wrote it dropped after it (a graceful stop, run.json). A checkpoint without totals (written
    by an older dflash_dist): the plan's samples through its cursor, counted as one launch."""
    zero = {"samples_sent": 0, "samples_trained": 0, "samples_skipped": 0, "samples_dropped_after_stop": 0,
            "launches": 0}
    if meta is None:
        return zero
    totals = meta.get("run_totals")
    if not isinstance(totals, dict) or set(zero) - set(totals):
        n = plan_samples(plan, int(meta["cursor"]))
        totals = dict(zero, samples_sent=n, samples_trained=n, launches=1)
    dropped = ((read_run_json(run_dir) or {}).get(DROPPED_KEY) or {}).get(os.path.basename(resume_from), 0)
    return dict(totals, samples_sent=totals["samples_sent"] + dropped,
                samples_dropped_after_stop=totals["samples_dropped_after_stop"] + dropped)


def checkpoint_totals(before: dict, launch: dict) -> dict:
    """The run's totals a checkpoint records (meta.json ``run_totals``): the earlier launches' (``earlier_totals``)
    plus this launch's samples through the checkpoint, summed over its drafters (``launch``: received, skipped).
    Samples received count as sent through this checkpoint; drops after a stop are the earlier launches' only."""
    b = before
    return {"samples_sent": b["samples_sent"] + launch["received"],  # sent through this checkpoint
            "samples_trained": b["samples_trained"] + launch["received"] - launch["skipped"],
            "samples_skipped": b["samples_skipped"] + launch["skipped"],
            "samples_dropped_after_stop": b["samples_dropped_after_stop"], "launches": b["launches"] + 1}


def record_dropped(run_dir: str, checkpoint: Optional[str], dropped: int) -> None:
    """Leader, after a graceful stop: the samples dropped after the checkpoint, for the totals of the launch
    that resumes from it."""
    run = read_run_json(run_dir)
    if run is None or checkpoint is None or not dropped:
        return
    run.setdefault(DROPPED_KEY, {})[os.path.basename(checkpoint)] = int(dropped)
    write_run_json(run_dir, run.pop("identity"), run)


def run_totals(before: dict, launch: dict, plan: list, cursor: int) -> dict:
    """The run's totals over all its launches (``run_*``) from the earlier ones and this launch's accounting.
    ``run_samples_repeated``: samples taken (trained or skipped) beyond the plan's samples through the cursor,
    0 unless a resume took some twice."""
    skipped = launch["samples_skipped_nonfinite"] + launch["samples_skipped_shape"]
    taken = before["samples_trained"] + before["samples_skipped"] + launch["samples_received"]
    return {"run_samples_sent": before["samples_sent"] + launch["samples_sent"],
            "run_samples_trained": before["samples_trained"] + launch["samples_trained"],
            "run_samples_skipped": before["samples_skipped"] + skipped,
            "run_samples_dropped_after_stop": before["samples_dropped_after_stop"]
            + launch["samples_dropped_after_stop"],
            "run_samples_repeated": taken - plan_samples(plan, cursor), "run_launches": before["launches"] + 1}
