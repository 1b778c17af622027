"""The job: validated config, target config, tokenizer, tokenized data, batching plan, resume point and
the split of ranks, identical on every rank except ``dist``. A role loop gets only its view of it
(``role_jobs.TargetJob`` / ``DrafterJob``): what that role reads, nothing of the setup."""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from dflash_dist.checkpoint.identity import data_identity, differences, drafter_identity, plan_identity, target_identity
from dflash_dist.checkpoint.resume import (  # noqa: F401  (resolve_run: the pure decision, for tools and tests)
    check_resume_point,
    claim_and_resolve,
    new_run_hint,
    read_meta,
    resolve_run,
    write_run_files,
)
from dflash_dist.checkpoint.store import CheckpointError
from dflash_dist.comm.distributed import Dist, init_distributed, make_ctrl_group, make_groups, setup_logging
from dflash_dist.comm.topology import TopologyError, make_topology
from dflash_dist.config import ConfigError, JobConfig, check_split, resolve_device, split_targets, validate_job
from dflash_dist.data.batching import build_plan
from dflash_dist.data.conversations import PACKAGED_SOURCES, DataError
from dflash_dist.data.prepare import build_dataset, cache_paths
from dflash_dist.data.tokenize import TokenizedDataset, cache_key
from dflash_dist.planning.memory import check_memory_for_data
from dflash_dist.storage import StorageError

log = logging.getLogger("dflash_dist")


@dataclass
class Job:
    """The whole job, identical on every rank except ``dist``; a role loop gets its view (role_jobs.role_view)."""
    cfg: JobConfig
    dist: Optional[Dist]  # None until the split is known (and in single-process tools: dflash-plan)
    run_dir: str
    hf_config: object
    layer_ids: list
    mask_token_id: int
    tokenizer_path: str
    dataset_path: str
    holdout_path: str
    plan: list            # list of lists of sample ids (global, independent of the split)
    total_messages: int   # messages this training run covers in total (fixed at the first launch)
    start_cursor: int     # messages already trained (resume)
    start_step: int
    resume_from: Optional[str]
    life: object = None   # lifecycle.Lifecycle: signals, stop agreement, failure reports
    sample_lengths: Optional[list] = None  # token length of every sample (plan shapes for the compile guard)
    auto_split: Optional[dict] = None  # topology.target_ranks=auto: measured rates and the chosen split (plan.json)
    plan_record: Optional[dict] = None  # auto_split's ``kind: plan`` metrics record, built once with it
    identity: Optional[dict] = None    # what the run belongs to (checkpoint.identity), recorded in every checkpoint
    epoch_messages: int = 0            # messages of the first epoch of the plan
    epochs_messages: int = 0           # messages of train.epochs epochs of the plan
    resumed_meta: Optional[dict] = None  # meta.json of the checkpoint resumed from
    nothing_left: Optional[str] = None   # a resumed run with nothing left to train: why (every rank exits 0)
    ctrl: object = None                  # the ctrl group while ``dist`` is None (a run with nothing left to train)
    drafter: object = None               # model.spec.DrafterSpec: the drafter resolved once (shape, backend, loss)


USAGE_ERRORS = (StorageError, ConfigError, DataError, CheckpointError)  # a subclass before its base


def on_rank0(ctrl, rank: int, fn):
    """Run ``fn`` on rank 0 and hand its result to every rank (``ctrl``: gloo group of all ranks; None: one process).
    A ConfigError, DataError or CheckpointError of rank 0 is raised on every rank with the same message, so that every rank stops
    at the same point with the same exit status and none is left waiting in a collective on a dead peer."""
    if ctrl is None:
        return fn()
    payload, err = [None], None
    if rank == 0:
        try:
            payload = [("ok", fn())]
        except USAGE_ERRORS as e:
            err, payload = e, [(next(c.__name__ for c in USAGE_ERRORS if isinstance(e, c)), str(e))]
        except BaseException as e:
            err, payload = e, [("failed", f"rank 0 failed: {type(e).__name__}: {e}")]
    dist.broadcast_object_list(payload, src=0, group=ctrl)
    kind, value = payload[0]
    if kind == "ok":
        return value
    if err is not None:
        raise err
    for cls in USAGE_ERRORS:  # raised here as on rank 0
        if kind == cls.__name__:
            raise cls(value)
    raise RuntimeError(value)


def prepare_data(cfg: JobConfig, rank: int, ctrl, cache: str, tok_path: str, vocab: int,
                 key: str) -> tuple[str, str]:
    """Rank 0 tokenizes once (data/prepare.py) into a cache; everyone else waits for it (``ctrl``) and reads it.
    A data error is raised on every rank (on_rank0). ``ctrl`` None: a single process (dflash-plan)."""
    on_rank0(ctrl, rank, lambda: build_dataset(cfg.data, cache, tok_path, vocab, key))
    return cache_paths(cache, key)[:2]


def plan_for(lengths: list, cfg: JobConfig, epochs: int) -> list:
    return build_plan(lengths, list(range(len(lengths))), epochs=epochs, seed=cfg.data.shuffle_seed,
                      max_batch_tokens=cfg.target.max_batch_tokens, max_batch_samples=cfg.target.max_batch_samples,
                      sort_window_batches=cfg.data.sort_window_batches)


def check_job_config(cfg: JobConfig, world_size: Optional[int], device_type: str) -> dict:
    """The checks a job makes before any model loads (paths, target and tokenizer configs, data.max_length against
    the target's positions, the split, layer ids,
    the drafter's shape, the target's attention implementation, fast paths and packing, the data source), shared
    by training and dflash-doctor so both refuse the same configs with the same message. ``world_size`` None
    skips the checks of the split. Returns what they resolved."""
    from transformers import AutoTokenizer

    from dflash_dist.targets.fast_path import check_fast_path_for_config, check_quantization_for_config
    from dflash_dist.targets.hf import (
        attn_note,
        check_target_paths,
        load_hf_config,
        resolve_attn_implementation,
        resolve_mask_token_id,
        text_config,
        tokenizer_path,
    )
    from dflash_dist.model.spec import resolve_drafter
    from dflash_dist.roles.target_rank.capture import check_packing_config
    check_target_paths(cfg)
    hf_config = load_hf_config(cfg.target)
    tc = text_config(hf_config)
    from dflash_dist.model.rope import check_positions
    scaled = check_positions(cfg.data.max_length, tc)  # longer samples than the target's positions: refused here
    if scaled:
        log.info("%s", scaled)
    tok_path = tokenizer_path(cfg.target)
    tok = AutoTokenizer.from_pretrained(tok_path)
    mask_id = resolve_mask_token_id(cfg, tok, tc.vocab_size)
    layer_ids = validate_job(cfg, world_size, tc.num_hidden_layers, tc.vocab_size, mask_id)
    drafter = resolve_drafter(cfg.drafter, tc, len(layer_ids), device_type)  # the drafter's settings, derived once
    attn = resolve_attn_implementation(cfg.target, hf_config, device_type)
    fast_path = check_fast_path_for_config(hf_config, cfg.target.fast_path, device_type, attn,
                                           attn_note(cfg.target, hf_config, device_type))
    check_packing_config(cfg.target, hf_config)  # target.packing=on for a hybrid: refused before weights load
    check_quantization_for_config(cfg.target, hf_config, device_type)  # an FP8 target without an FP8 GEMM
    src = cfg.data.source
    if src not in PACKAGED_SOURCES and not src.startswith("synthetic:") and not os.path.exists(src):
        raise ConfigError(f"data.source={src!r}: no such file or directory (builtin, builtin_original, a .jsonl/.json/.parquet/.arrow "
                          "file or a datasets save_to_disk directory)")
    from dflash_dist.planning.memory import check_memory
    memory = check_memory(cfg, tc, hf_config, drafter, device_type, len(layer_ids), world_size, attn)  # warns
    return {"hf_config": hf_config, "text_config": tc, "tokenizer_path": tok_path, "mask_token_id": mask_id,
            "layer_ids": layer_ids, "attn_implementation": attn, "fast_path": fast_path, "drafter": drafter,
            "memory": memory}


def build_job(cfg: JobConfig, rank: int, world_size: Optional[int], ctrl, device_type: str) -> Job:
    """Everything but the split: target config, tokenizer, validation (before any model loads), the run directory
    and resume point (refused before any model loads when the run or checkpoint belongs to other settings), the
    tokenized data and the batching plan. Shared by ``setup`` (every rank; ``ctrl`` agreement around rank 0's
    decisions) and dflash-plan (one process: world_size and ctrl None, no run directory, no resume). ``dist`` is
    left None; ``total_messages`` is the plan of train.epochs until ``setup`` fixes it for train.max_steps."""
    checked = check_job_config(cfg, world_size, device_type)
    hf_config, tc, tok_path, mask_id, layer_ids, drafter = (
        checked[k] for k in ("hf_config", "text_config", "tokenizer_path", "mask_token_id", "layer_ids", "drafter"))
    part = {"target": target_identity(cfg, hf_config),
            "drafter": drafter_identity(cfg, layer_ids, mask_id, tc.hidden_size)}

    def decide() -> dict:
        identity = dict(data_identity(cfg, tok_path, tc.vocab_size), **part)
        if world_size is None:  # dflash-plan: no run, no resume
            run = {"run_dir": cfg.train.output_dir or os.path.join(tempfile.gettempdir(), "dflash-plan"),
                   "resume_from": None}
        else:
            run = claim_and_resolve(cfg, identity)
        return dict(run, identity=identity)

    run = on_rank0(ctrl, rank, decide)
    run_dir, resume_from, identity = run["run_dir"], run["resume_from"], run["identity"]
    if rank == 0:
        log.info("target layers %s of %d, mask token %d, device %s", layer_ids, tc.num_hidden_layers, mask_id,
                 device_type)
        if world_size is not None:
            log.info("run directory: %s (%s)", run_dir, f"resuming {resume_from}" if resume_from else "new run")
    cache = cfg.data.cache_dir or os.path.join(run_dir, "data_cache")
    ds_path, ho_path = prepare_data(cfg, rank, ctrl, cache, tok_path, tc.vocab_size, cache_key(identity["data"]["hash"], identity["tokenizer"]["hash"]))

    ds = TokenizedDataset.load(ds_path)
    lengths = ds.lengths.tolist()
    epoch_plan = plan_for(lengths, cfg, 1)
    identity["plan"] = plan_identity(epoch_plan)
    check_memory_for_data(cfg, checked, lengths, epoch_plan, world_size, device_type)  # refused here
    plan = plan_for(lengths, cfg, cfg.train.epochs)
    job = Job(cfg=cfg, dist=None, run_dir=run_dir, hf_config=hf_config, drafter=drafter, layer_ids=layer_ids,
              mask_token_id=mask_id,
              tokenizer_path=tok_path, dataset_path=ds_path, holdout_path=ho_path, plan=plan,
              total_messages=len(plan), start_cursor=0, start_step=0, resume_from=resume_from,
              sample_lengths=lengths, identity=identity, epoch_messages=len(epoch_plan),
              epochs_messages=len(plan))
    if resume_from is not None:
        meta = read_meta(resume_from)
        diffs = differences(meta.get("identity"), identity, parts=("plan",))
        if diffs:  # the same on every rank: every rank raises it
            raise ConfigError(f"train.resume: checkpoint {resume_from} (run {run_dir}) belongs to another batching "
                              f"plan:\n  - {diffs[0]}\n" + new_run_hint(run_dir))
        check_resume_point(meta, resume_from)  # the same on every rank: every rank raises it
        job.start_cursor, job.start_step = meta["cursor"], meta["step"]
        job.resumed_meta = meta
        if rank == 0:
            log.info("resuming from %s: step %d, %d of %d messages trained", resume_from, job.start_step,
                     job.start_cursor, meta["total_messages"])
    job.nothing_left = _nothing_left(job)
    return job


def _nothing_left(job: Job) -> Optional[str]:
    """Why a resumed run has nothing to train (its settings asked for no more than it trained), or None."""
    if job.resume_from is None:
        return None
    t = job.cfg.train
    if t.max_steps > 0:
        if job.start_step < t.max_steps:
            return None
        asked = f"train.max_steps={t.max_steps}"
    else:
        if job.start_cursor < _epochs_total(job):
            return None
        asked = f"train.epochs={t.epochs} ({_epochs_total(job)} messages)"
    return (f"nothing left to train: {job.resume_from} has trained {job.start_step} steps ({job.start_cursor} "
            f"messages) and {asked} asks for no more. To train on, raise train.max_steps (or train.epochs with "
            f"train.max_steps=-1); for a new run, leave train.output_dir unset or set another one, with "
            f"train.resume=none.")


def _epochs_total(job: Job) -> int:
    """Messages of train.epochs epochs (each epoch packs its own shuffle: their sizes differ a little)."""
    return job.epochs_messages


def _extend_plan(job: Job, n_messages: int) -> None:
    """More epochs of the same plan until it holds ``n_messages`` (the first epochs unchanged)."""
    epochs = max(1, -(-n_messages // max(job.epoch_messages, 1)))
    while len(job.plan) < n_messages:
        job.plan = plan_for(job.sample_lengths, job.cfg, epochs)
        epochs += 1


def fix_total(job: Job, num_drafters: int) -> None:
    """The messages this run covers in total. train.max_steps > 0: exactly that many optimizer steps (the data
    repeats as needed: more epochs in the plan); else train.epochs over the data. A resume continues the
    checkpoint's total when these keys are unchanged, else trains up to what they now ask for (logged)."""
    t, meta = job.cfg.train, job.resumed_meta
    log0 = log.info if job.dist is None or job.dist.rank == 0 else log.debug
    if t.max_steps > 0:
        want = job.start_cursor + (t.max_steps - job.start_step) * num_drafters
        how = (f"train.max_steps={t.max_steps}: {t.max_steps} optimizer steps x {num_drafters} drafter(s) = "
               f"{t.max_steps * num_drafters} messages, {t.max_steps * num_drafters / max(job.epoch_messages, 1):.2f} "
               f"epoch(s) of {job.epoch_messages} messages (train.epochs is not used)")
    else:
        want = _epochs_total(job)
        how = (f"train.epochs={t.epochs}: {want} messages ({job.epoch_messages} in the first epoch, as run.json "
               f"records)")
    if meta is not None:
        before = (meta.get("job_config") or {}).get("train", {})
        same = before.get("max_steps") == t.max_steps and (t.max_steps > 0 or before.get("epochs") == t.epochs)
        old = int(meta["total_messages"])
        if same:
            want = old
        elif want != old:
            log0("resume: %s, so the run %s from %d to %d messages (the learning-rate schedule follows the new "
                 "total); %d messages left to train", how, "extends" if want > old else "shortens", old, want,
                 want - job.start_cursor)
    else:
        log0("%s", how)
    _extend_plan(job, want)
    job.total_messages = want


def setup(cfg: JobConfig) -> Job:
    device_type = resolve_device(cfg)
    timeout_s = cfg.topology.warmup_timeout_s
    if device_type == "cuda":
        import torch
        local, gpus = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
        if local >= gpus:  # before set_device's "invalid device ordinal"
            raise ConfigError(f"local rank {local} has no GPU of its own on a node with {gpus} GPU(s): start one "
                              f"process per GPU (torchrun --nproc-per-node {gpus}); every rank can hold both roles "
                              f"(topology.target_ranks=0)")
    rank, world, device = init_distributed(device_type, timeout_s)
    check_split(cfg, world)  # before the role's logging needs the split
    t = split_targets(cfg, world)
    auto = t == "auto"
    def topology(t: int):
        try:
            return make_topology(world, rank, t, cfg.target.tensor_parallel, cfg.topology.cross_node)
        except TopologyError as e:
            raise ConfigError(f"topology.target_ranks={t}: {e}") from None
    setup_logging(rank, "auto" if auto else topology(t).role)
    # Same group order on every rank and on both paths: ctrl now (the data preparation below waits on its
    # barrier), the drafters group once the split is known (with auto: measured after the data is ready).
    ctrl = make_ctrl_group(timeout_s)
    job = build_job(cfg, rank, world, ctrl, device_type)
    if job.nothing_left is not None:
        job.ctrl = ctrl
        return job  # train.run says so and every rank exits 0, before any model loads
    if rank == 0:
        write_run_files(job)
    if auto:  # from a dflash-plan plan.json (topology.plan), or measured now
        from dflash_dist.planning.startup import split_for_job
        t = split_for_job(job, rank, world, device)
    topo = topology(t)
    setup_logging(rank, topo.role)
    job.dist = make_groups(topo, device, timeout_s, ctrl, heads=cfg.drafter.tuning.loss_on_target)
    fix_total(job, topo.num_drafters)
    if rank == 0:
        log.info("topology: %s", topo.describe())
    return job
