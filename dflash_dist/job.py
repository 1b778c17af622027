"""The job: validated config, target config, tokenizer, tokenized data, batching plan, resume point and
the split of ranks -- everything a role loop needs, identical on every rank except ``dist``."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from dflash_dist.comm.distributed import Dist, init_distributed, make_ctrl_group, make_groups, setup_logging
from dflash_dist.comm.topology import Topology
from dflash_dist.config import ConfigError, JobConfig, resolve_device, validate_job
from dflash_dist.data.conversations import BadDataStats, builtin_conversations
from dflash_dist.data.plan import build_plan
from dflash_dist.data.sources import prepare_conversations
from dflash_dist.data.tokenize import TokenizedDataset

log = logging.getLogger("dflash_dist")


@dataclass
class Job:
    """Everything a role loop needs, identical on every rank except ``dist``."""
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


def _dataset_key(cfg: JobConfig, tok_path: str, vocab: int) -> str:
    src = cfg.data.source
    if src.startswith("synthetic:"):
        return hashlib.sha1(json.dumps([src, cfg.data.max_length, cfg.data.shuffle_seed, vocab]).encode()
                            ).hexdigest()[:12]
    if src != "builtin" and os.path.exists(src):
        st = os.stat(src)
        src = f"{os.path.abspath(src)}:{st.st_size}:{st.st_mtime_ns}"
    builtin_stamp = ""
    if cfg.data.source == "builtin":
        builtin_stamp = str(len(builtin_conversations()))
    blob = json.dumps([src, builtin_stamp, os.path.abspath(tok_path), cfg.data.max_length, cfg.data.overlong,
                       cfg.data.holdout, cfg.data.shuffle_seed, vocab, sorted(cfg.data.chat_template_kwargs.items())],
                      default=repr)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def prepare_data(cfg: JobConfig, rank: int, ctrl, run_dir: str, tok_path: str, vocab: int) -> tuple[str, str]:
    """Rank 0 tokenizes once (worker processes) into a cache; everyone else waits (``ctrl`` barrier) and reads
    it. ``ctrl`` None: a single process (dflash-plan)."""
    cache = cfg.data.cache_dir or os.path.join(run_dir, "data_cache")
    key = _dataset_key(cfg, tok_path, vocab)
    ds_path = os.path.join(cache, f"train-{key}.pt")
    ho_path = os.path.join(cache, f"holdout-{key}.jsonl")
    if rank == 0 and cfg.data.source.startswith("synthetic:") and not os.path.exists(ds_path):
        from dflash_dist.data.synthetic import synthetic_dataset
        os.makedirs(cache, exist_ok=True)
        synthetic_dataset(cfg.data.source, vocab, cfg.data.max_length, cfg.data.shuffle_seed).save(ds_path)
        with open(ho_path, "w"):
            pass
    elif rank == 0 and not (os.path.exists(ds_path) and os.path.exists(ho_path)):
        os.makedirs(cache, exist_ok=True)
        stats = BadDataStats()
        if cfg.data.source != "builtin" and not os.path.exists(cfg.data.source):
            raise ConfigError(f"data.source={cfg.data.source!r}: no such file or directory (builtin, a .jsonl/.json/"
                              ".parquet/.arrow file or a datasets save_to_disk directory)")
        t0 = time.time()
        # streamed (two passes: count, then tokenize): the corpus is never in memory, only its tokens
        ds, held = prepare_conversations(cfg.data.source, cfg.data.holdout, cfg.data.shuffle_seed, tok_path,
                                         cfg.data.max_length, cfg.data.overlong, cfg.data.num_workers, stats,
                                         vocab_size=vocab, chat_template_kwargs=cfg.data.chat_template_kwargs)
        stats.check(cfg.data.max_bad_fraction)
        if stats.bad_rows or stats.notes:
            log.warning("data: %s", stats.summary())
        log.info("data: %d training samples, %d tokens, %d held-out prompts (tokenized in %.1f s)",
                 len(ds), int(ds.lengths.sum()), len(held), time.time() - t0)
        ds.save(ds_path)
        tmp = ho_path + ".tmp"
        with open(tmp, "w") as f:
            for conv in held:
                f.write(json.dumps(conv) + "\n")
        os.replace(tmp, ho_path)
    if ctrl is not None:
        dist.barrier(group=ctrl)
    return ds_path, ho_path


def build_job(cfg: JobConfig, rank: int, world_size: Optional[int], ctrl, device_type: str) -> Job:
    """Everything but the split: target config, tokenizer, validation (before any model loads), the tokenized
    data and the batching plan, the resume point. Shared by ``setup`` (every rank; ``ctrl`` barrier around the
    data) and dflash-plan (one process: world_size and ctrl None). ``dist`` is left None; ``total_messages`` is
    the whole plan until ``setup`` caps it at train.max_steps * drafters (a resumed run keeps its own)."""
    from transformers import AutoTokenizer

    from dflash_dist.model.hf import load_hf_config, text_config, tokenizer_path
    from dflash_dist.target.capture import check_packing_config
    hf_config = load_hf_config(cfg.target)
    tc = text_config(hf_config)
    tok_path = tokenizer_path(cfg.target)
    tok = AutoTokenizer.from_pretrained(tok_path)
    mask_id = resolve_mask_token_id(cfg, tok, tc.vocab_size)
    layer_ids = validate_job(cfg, world_size, tc.num_hidden_layers, tc.vocab_size, mask_id)
    from dflash_dist.model.drafter import DrafterModelConfig
    DrafterModelConfig.from_target(tc, num_layers=cfg.drafter.num_layers, num_feature_layers=len(layer_ids),
                                   block_size=cfg.drafter.block_size, intermediate_size=cfg.drafter.intermediate_size,
                                   layer_types=cfg.drafter.layer_types, sliding_window=cfg.drafter.sliding_window)
    from dflash_dist.model.fast_path import check_fast_path_for_config
    check_fast_path_for_config(hf_config, cfg.target.fast_path, device_type, cfg.target.attn_implementation)
    check_packing_config(cfg.target, hf_config)  # target.packing=on for a hybrid: refused before weights load

    run_dir = cfg.train.output_dir
    if rank == 0:
        log.info("target layers %s of %d, mask token %d, device %s", layer_ids, tc.num_hidden_layers, mask_id,
                 device_type)
    ds_path, ho_path = prepare_data(cfg, rank, ctrl, run_dir, tok_path, tc.vocab_size)

    ds = TokenizedDataset.load(ds_path)
    plan = build_plan(ds.lengths.tolist(), list(range(len(ds))), epochs=cfg.train.epochs,
                               seed=cfg.data.shuffle_seed, max_batch_tokens=cfg.target.max_batch_tokens,
                               max_batch_samples=cfg.target.max_batch_samples,
                               sort_window_batches=cfg.data.sort_window_batches)
    total = len(plan)
    cursor, step, resume_from = 0, 0, None
    from dflash_dist.checkpoint.store import checkpoint_problem, find_latest
    if cfg.train.resume not in ("none", "", None):
        resume_from = find_latest(run_dir) if cfg.train.resume == "auto" else cfg.train.resume
        if resume_from is not None:
            problem = checkpoint_problem(resume_from)
            if problem:
                raise ConfigError(f"train.resume={resume_from}: {problem}")
            with open(os.path.join(resume_from, "meta.json")) as f:
                meta = json.load(f)
            cursor, step, total = meta["cursor"], meta["step"], meta["total_messages"]
            if rank == 0:
                log.info("resuming from %s: step %d, %d of %d messages trained", resume_from, step, cursor, total)
    return Job(cfg=cfg, dist=None, run_dir=run_dir, hf_config=hf_config, layer_ids=layer_ids, mask_token_id=mask_id,
               tokenizer_path=tok_path, dataset_path=ds_path, holdout_path=ho_path, plan=plan, total_messages=total,
               start_cursor=cursor, start_step=step, resume_from=resume_from, sample_lengths=ds.lengths.tolist())


def setup(cfg: JobConfig) -> Job:
    device_type = resolve_device(cfg)
    timeout_s = cfg.topology.warmup_timeout_s
    rank, world, device = init_distributed(device_type, timeout_s)
    auto = cfg.topology.target_ranks == "auto"
    if auto:
        if world < 2:
            raise ConfigError(f"topology.target_ranks=auto needs at least 2 processes (one target, one drafter), "
                              f"got a world of {world}: start more processes")
    else:
        t = int(cfg.topology.target_ranks)
        if t >= world:
            raise ConfigError(f"topology.target_ranks={t} leaves no drafter rank in a world of {world}: set "
                              f"topology.target_ranks to at most {world - 1} or start more processes")
    setup_logging(rank, "auto" if auto else Topology(world, rank, t).role)
    # Same group order on every rank and on both paths: ctrl now (the data preparation below waits on its
    # barrier), the drafters group once the split is known (with auto: measured after the data is ready).
    ctrl = make_ctrl_group(timeout_s)
    if rank == 0:
        os.makedirs(cfg.train.output_dir, exist_ok=True)
        with open(os.path.join(cfg.train.output_dir, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=1)
    job = build_job(cfg, rank, world, ctrl, device_type)
    if auto:
        from dflash_dist.autosplit import auto_split
        job.auto_split = auto_split(job, rank, world, device)
        t = int(job.auto_split["target_ranks"])
    topo = Topology(world, rank, t)
    setup_logging(rank, topo.role)
    job.dist = make_groups(topo, device, timeout_s, ctrl, heads=cfg.drafter.tuning.loss_on_target)
    if job.resume_from is None and cfg.train.max_steps > 0:
        job.total_messages = min(job.total_messages, cfg.train.max_steps * topo.num_drafters)
    if rank == 0:
        log.info("topology: %s", topo.describe())
    return job


def resolve_mask_token_id(cfg: JobConfig, tok, vocab_size: int) -> int:
    if cfg.drafter.mask_token_id is not None:
        return int(cfg.drafter.mask_token_id)
    if getattr(tok, "mask_token_id", None) is not None:
        return int(tok.mask_token_id)
    mid = tok.convert_tokens_to_ids("<|MASK|>")
    if isinstance(mid, int) and mid != tok.unk_token_id and mid is not None and mid >= 0:
        return int(mid)
    if len(tok) < vocab_size:  # first embedding row no token uses (Qwen3: 151669)
        return len(tok)
    raise ConfigError("no mask token: set drafter.mask_token_id to an id in the target vocabulary")
