"""A drafter rank without the pipeline: the real ``DrafterTrainer`` fed messages built in-process.

Used by bench/pipeline.py (drafter alone, synthetic features) and bench/threaded_baseline.py (features from a
target thread). The job is composed from the same Hydra overrides as the real ``python -m dflash_dist.train``
run, the dataset and batching plan are the ones ``job.setup`` builds (same synthetic source, seed, token
budget), and every message has the sizes the transport would deliver (sample ids, cu_seqlens, token ids, loss
mask on the device, features [tokens, 5*H] in the target dtype). The only stand-ins: a world-size-1 process group
for DDP, and the frozen embedding / lm_head of a random-init target made locally instead of received from the
target rank (same shapes and dtype).
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Optional

import _common as C
import torch
import torch.distributed as dist

# ---------------------------------------------------------------------------------------------- job

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
    return JobConfig.from_omegaconf(compose_config(overrides, os.path.join(C.REPO, "conf")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process_group(device: torch.device) -> None:
    """World size 1 (the DDP group of a job with one drafter rank)."""
    if dist.is_initialized():
        return
    kw = {"init_method": f"tcp://127.0.0.1:{free_port()}", "rank": 0, "world_size": 1,
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
    from dflash_dist.model.hf import load_hf_config, resolve_mask_token_id, text_config, tokenizer_path
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
    from dflash_dist.model.spec import resolve_drafter
    drafter = resolve_drafter(cfg.drafter, tc, len(layer_ids), device.type)
    job = SimpleNamespace(cfg=cfg, dist=d, run_dir=run_dir, hf_config=hf_config, drafter=drafter, layer_ids=layer_ids,
                          mask_token_id=mask_id, tokenizer_path=tok_path, dataset_path=None, holdout_path=None,
                          plan=plan, total_messages=total, start_cursor=0, start_step=0, resume_from=None,
                          life=None, sample_lengths=ds.lengths.tolist())
    return job, ds


def make_trainer(job):
    """``drafter_loop.DrafterTrainer`` for job. A random-init target's embedding / lm_head are made here (the real
    drafter receives them from the target rank: same shapes and dtype); a checkpoint target's are read from it."""
    from dflash_dist.drafter import trainer as drafter_loop
    from dflash_dist.model.hf import resolve_dtype, resolve_source, text_config
    original = drafter_loop.receive_head_weights

    def local_head_weights(job_, device):
        path, _ = resolve_source(job_.cfg.target)
        if path is not None:
            return original(job_, device)
        tc = text_config(job_.hf_config)
        dtype = resolve_dtype(job_.cfg.target.dtype, device.type)
        g = torch.Generator(device=device).manual_seed(job_.cfg.target.init_seed)
        shape = (tc.vocab_size, tc.hidden_size)
        embed = (torch.randn(shape, generator=g, device=device) * 0.02).to(dtype)
        head = (torch.randn(shape, generator=g, device=device) * 0.02).to(dtype)
        return embed, head

    drafter_loop.receive_head_weights = local_head_weights
    try:
        trainer = drafter_loop.DrafterTrainer(job)
    finally:
        drafter_loop.receive_head_weights = original
    return trainer


def my_messages(job) -> list[int]:
    """Run-message indices of drafter rank 0, in step order (drafter_loop.run_drafter's schedule)."""
    topo = job.dist.topo
    return list(topo.drafter_messages(job.total_messages - job.start_cursor))


def make_message(job, ds, j: int, device: torch.device, features: torch.Tensor):
    """transport.Message for run-message j, laid out as Receiver.complete() returns it (meta on the device)."""
    from dflash_dist.comm.transport import Message, pack_meta, unpack_meta
    k = job.start_cursor + j
    samples = [ds[i] for i in job.plan[k]]
    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.long)
    cu = torch.zeros(len(samples) + 1, dtype=torch.long)
    cu[1:] = lengths.cumsum(0)
    ids = torch.cat([s.input_ids.long() for s in samples])
    mask = torch.cat([s.loss_mask.bool() for s in samples])
    sample_ids = torch.tensor(job.plan[k], dtype=torch.long)
    meta = pack_meta(sample_ids, cu, ids, mask).to(device)
    sid, cu_d, ids_d, mask_d = unpack_meta(meta, len(samples), int(ids.numel()))
    msg = Message(k, sid, cu_d, ids_d, mask_d, features, src=job.dist.topo.target_for(j))
    msg.validate()
    return msg


def message_tokens(job, ds, j: int) -> int:
    return int(sum(int(ds.lengths[i]) for i in job.plan[job.start_cursor + j]))


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
