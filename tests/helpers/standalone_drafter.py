"""A drafter rank without the pipeline: the real ``DrafterTrainer`` fed messages built in-process.

Used by test workers (tests/helpers/precompile_ddp_worker.py, split_invariance_worker.py), unit tests of the
trainer and the bench scripts (bench/_standalone.py re-exports it). The job is composed from the same Hydra
overrides as the real ``python -m dflash_dist.train`` run, the synthetic dataset and batching plan from the same
source, seed and token budget, and every message is built as the transport delivers it
(``planning.measure.plan_message``). The only stand-ins: the caller's process group for DDP, and a random-init
target's frozen embedding / lm_head made locally (``planning.measure.random_head_weights``) instead of received
from the target rank (same shapes and dtype).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist
from helpers.launch_util import REPO


def job_overrides(tiny: bool, target: Optional[str], drafter: Optional[str], mean_len: int, num_samples: int,
                  max_batch_tokens: int, max_batch_samples: int, steps: int, log_every: int, output_dir: str,
                  extra: list) -> list[str]:
    ov = [f"target={target or ('tiny' if tiny else 'qwen3_8b_random')}",
          f"drafter={drafter or ('tiny' if tiny else 'dflash')}",
          f"data.source=synthetic:{mean_len}:{num_samples}",
          f"target.max_batch_tokens={max_batch_tokens}", f"target.max_batch_samples={max_batch_samples}",
          f"train.max_steps={steps}", f"logging.log_every={log_every}", f"train.output_dir={output_dir}",
          "logging.wandb.mode=disabled", "logging.progress_bar=false"]
    return ov + list(extra or [])


def compose_job_config(overrides: list[str]):
    """The JobConfig that ``python -m dflash_dist.train <overrides>`` would run (Hydra compose of conf/)."""
    from dflash_dist.config import JobConfig, compose_config
    return JobConfig.from_omegaconf(compose_config(overrides, os.path.join(REPO, "conf")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process_group(device: torch.device) -> None:
    """World size 1 (the DDP group of a job with one drafter rank)."""
    if dist.is_initialized():
        return
    kw = {"init_method": f"tcp://127.0.0.1:{_free_port()}", "rank": 0, "world_size": 1,
          "timeout": timedelta(seconds=600)}
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device, **kw)
    else:
        dist.init_process_group("gloo", **kw)


def make_job(cfg, world_size: int, device: torch.device, run_dir: str):
    """(job, dataset) as job.setup would make them for the first drafter rank (global rank 0)."""
    from transformers import AutoTokenizer

    from dflash_dist.comm.topology import Topology
    from dflash_dist.config import validate_job
    from dflash_dist.data.batching import build_plan
    from dflash_dist.data.synthetic import synthetic_dataset
    from dflash_dist.targets.hf import load_hf_config, resolve_mask_token_id, text_config, tokenizer_path
    from dflash_dist.model.spec import resolve_drafter
    if not cfg.data.source.startswith("synthetic:"):
        raise SystemExit("the standalone drafter needs data.source=synthetic:...")
    hf_config = load_hf_config(cfg.target)
    tc = text_config(hf_config)
    tok_path = tokenizer_path(cfg.target)
    mask_id = resolve_mask_token_id(cfg, AutoTokenizer.from_pretrained(tok_path), tc.vocab_size)
    layer_ids = validate_job(cfg, world_size, tc.num_hidden_layers, tc.vocab_size, mask_id)
    ds = synthetic_dataset(cfg.data.source, tc.vocab_size, cfg.data.max_length, cfg.data.shuffle_seed)
    plan = build_plan(ds.lengths.tolist(), list(range(len(ds))), epochs=cfg.train.epochs,
                      seed=cfg.data.shuffle_seed, max_batch_tokens=cfg.target.max_batch_tokens,
                      max_batch_samples=cfg.target.max_batch_samples)
    topo = Topology(world_size, 0, int(cfg.topology.target_ranks))
    total = len(plan)
    if cfg.train.max_steps > 0:
        total = min(total, cfg.train.max_steps * topo.num_drafters)
    group = dist.group.WORLD
    d = SimpleNamespace(topo=topo, device=device, ctrl=None, data=group, drafters=group, drafters_cpu=None,
                        store=None, rank=0)
    drafter = resolve_drafter(cfg.drafter, tc, len(layer_ids), device.type)
    job = SimpleNamespace(cfg=cfg, dist=d, run_dir=run_dir, hf_config=hf_config, drafter=drafter, layer_ids=layer_ids,
                          mask_token_id=mask_id, tokenizer_path=tok_path, dataset_path=None, holdout_path=None,
                          plan=plan, total_messages=total, start_cursor=0, start_step=0, resume_from=None,
                          life=None, sample_lengths=ds.lengths.tolist())
    return job, ds


def make_trainer(job):
    """``DrafterTrainer`` for job: a checkpoint target's embedding / lm_head read from it, a random-init target's
    made here (the real drafter receives them from the target rank: same shapes and dtype)."""
    from dflash_dist.roles.drafter_rank.trainer import DrafterTrainer
    from dflash_dist.targets.hf import resolve_source
    from dflash_dist.planning.measure import random_head_weights
    path, _ = resolve_source(job.cfg.target)
    return DrafterTrainer(job, head_weights=None if path is not None else random_head_weights(job, job.dist.device))


def my_messages(job) -> list[int]:
    """Run-message indices of drafter rank 0, in step order (the drafter loop's schedule)."""
    return list(job.dist.topo.drafter_messages(job.total_messages - job.start_cursor))


def make_message(job, ds, j: int, device: torch.device, features: torch.Tensor):
    """transport.Message for run-message j with ``features`` [tokens, n_layers * H], as the receiver delivers it."""
    from dflash_dist.planning.measure import plan_message
    return plan_message(job, ds, job.start_cursor + j, lambda tokens: features.to(device),
                        src=job.dist.topo.target_for(j))


def message_tokens(job, ds, j: int) -> int:
    return int(sum(int(ds.lengths[i]) for i in job.plan[job.start_cursor + j]))
