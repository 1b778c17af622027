"""The two rates a split is chosen from, measured with the job's own code on its own data: one target rank's supply
(the target as ``target.loop.run_target`` builds it, on the plan's batches) and one drafter rank's demand
(``DrafterTrainer``'s step, alone, on the same messages with random features)."""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import time
from typing import TYPE_CHECKING, Optional

from dflash_dist.planning.split import rate_summary, timed_rounds

if TYPE_CHECKING:
    import torch

log = logging.getLogger("dflash_dist")

def calibration_messages(job, n: int) -> list[int]:
    """Plan indices of the first n messages the job trains (from the resume cursor, wrapping around). Both
    sides measure these, so with plan_target_batches == plan_drafter_steps they time the same samples."""
    return [(job.start_cursor + i) % len(job.plan) for i in range(min(int(n), len(job.plan)))]


def _sync(device: torch.device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """After a calibration model is dropped: give its memory back before the role loads the real one."""
    import torch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_target_supply(job, device: torch.device, batches: Optional[int] = None, build=None) -> dict:
    """Samples/s and tokens/s of one target rank: the target built as ``target.loop.run_target`` builds it
    (same loader / random init, fast-path policy, ``build_capture``: the same packing, compile and padding),
    run on the plan's messages exactly as the target loop batches them (pad_batch + capture + device sync, what it
    counts as busy), after warm-up: 1 batch, or with anything compiled (packing, target.compile) one pass over
    the measured batches, so no compile lands in the timed ones. The batches are timed in rounds
    (``timed_rounds``: topology.plan_rounds, plan_min_seconds); ``samples``/``tokens`` are one round's.
    ``build``: a callable returning the model (a rank's shard of a replica: every rank of the replica runs this
    together, and the rate is the replica's)."""
    from dflash_dist.data.tokenize import TokenizedDataset
    from dflash_dist.model.fast_path import check_target_fast_path
    from dflash_dist.model.hf import build_target_model
    from dflash_dist.target.batch import pad_batch
    from dflash_dist.target.capture import build_capture
    cfg = job.cfg
    ks = calibration_messages(job, batches or cfg.topology.plan_target_batches)
    t0 = time.monotonic()
    model = build() if build is not None else build_target_model(cfg.target, device.type)
    build_s = time.monotonic() - t0
    check_target_fast_path(model, cfg.target.fast_path, device.type)  # never time a refused fallback path
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    capture = build_capture(cfg.target, model, job.layer_ids, device.type)
    packed, compiled = capture.packing, capture.compile
    path = capture.describe()
    warmup = ks if (packed or compiled) else ks[:1]  # allocator, kernels, caches; compiles: every shape
    ds = TokenizedDataset.load(job.dataset_path)
    counts = []

    def run(batch_keys) -> None:
        samples = tokens = 0
        for k in batch_keys:
            ids, lengths, _, _ = pad_batch([ds[j] for j in job.plan[k]], device, packed)
            capture(ids, lengths)
            _sync(device)
            samples, tokens = samples + len(lengths), tokens + int(lengths.sum())
        counts.append((samples, tokens))

    try:
        run(warmup)
        secs = timed_rounds(lambda: run(ks), cfg.topology.plan_rounds, cfg.topology.plan_min_seconds)
    finally:
        capture.close()
        capture = model = None  # freed before the real roles load (run() holds a closure)
        free_memory(device)
    samples, tokens = counts[-1]  # every round the same batches
    return {**rate_summary(secs, samples, tokens), "batches": len(ks), "samples": samples, "tokens": tokens,
            "warmup_batches": len(warmup), "build_s": build_s, "device": str(device), "dtype": dtype,
            "messages": ks, "capture": path}


def measure_drafter_demand(job, device: torch.device, steps: Optional[int] = None) -> dict:
    """Samples/s of one drafter rank: ``DrafterTrainer`` built as the drafter role builds it (model config,
    backend, optimizer, compile settings and guard), alone (no DDP), with a random frozen embedding / lm_head of
    the target's shape and dtype; its full step (``build``: make_batch; ``train_step``: mask, forward,
    decayed CE, backward, clip, AdamW) on the plan's messages (real lengths and loss masks, random features of
    width n_layers * H in the target dtype), after warm-up: one step, or with flex one per batch shape timed
    (so no compile lands in the timed steps). The steps are timed in rounds (``timed_rounds``:
    topology.plan_rounds, plan_min_seconds); ``samples``/``tokens`` are one round's."""
    import torch

    from dflash_dist.comm.distributed import Dist
    from dflash_dist.comm.topology import Topology
    from dflash_dist.comm.transport import Message
    from dflash_dist.config import resolve_backend
    from dflash_dist.data.tokenize import TokenizedDataset
    from dflash_dist.drafter.trainer import DrafterTrainer
    from dflash_dist.model.hf import resolve_dtype, text_config
    from dflash_dist.target.batch import pad_batch
    cfg = job.cfg
    ks = calibration_messages(job, steps or cfg.topology.plan_drafter_steps)
    tc = text_config(job.hf_config)
    dtype = resolve_dtype(cfg.target.dtype, device.type)
    g = torch.Generator(device=device).manual_seed(cfg.target.init_seed)
    embed, head = ((torch.randn(tc.vocab_size, tc.hidden_size, generator=g, device=device) * 0.02).to(dtype)
                   for _ in range(2))
    # one drafter fed by one target, in this process: drafters=None is the trainer's "alone" mode
    alone = Dist(topo=Topology(2, 0, 1), device=device, ctrl=None, data=None, drafters=None, store=None)
    ds = TokenizedDataset.load(job.dataset_path)
    width = len(job.layer_ids) * tc.hidden_size
    fg = torch.Generator(device=device).manual_seed(0)

    def message(k: int) -> Message:
        """What the transport delivers for message k: ids / loss mask / features on the device, cu on the host."""
        _, lengths, ids, mask = pad_batch([ds[i] for i in job.plan[k]], "cpu")
        cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
        cu[1:] = lengths.cumsum(0)
        feats = torch.randn(int(cu[-1]), width, generator=fg, device=device).to(dtype)
        return Message(k, torch.tensor(job.plan[k], dtype=torch.long), cu, ids.to(device), mask.to(device), feats,
                       src=alone.topo.target_ranks[0])

    trainer = msgs = None
    try:
        trainer = DrafterTrainer(dataclasses.replace(job, dist=alone, resume_from=None, auto_split=None),
                                 head_weights=(embed, head))
        msgs = [message(k) for k in ks]  # built before the clock starts: the real drafter receives them ready
        warm, shapes = [], set()
        for k, m in zip(ks, msgs):
            lens = [int(x) for x in (m.cu_seqlens[1:] - m.cu_seqlens[:-1])]
            shape = (len(lens), max(1, math.ceil(max(lens) / cfg.drafter.tuning.ctx_bucket)))
            if not warm or (trainer.backend == "flex" and shape not in shapes):
                warm.append((k, m))
                shapes.add(shape)
        if trainer.guard is not None:
            trainer.guard.warmup_steps = None  # compiling is allowed until every timed shape has run once
        for k, m in warm:
            trainer.train_step(trainer.build(m, k))
        if trainer.guard is not None:
            trainer.guard.end_warmup()  # from here a compile in a timed step is an error, not a slow step
        _sync(device)

        def one_pass() -> None:
            for k, m in zip(ks, msgs):
                trainer.train_step(trainer.build(m, k))
            _sync(device)

        secs = timed_rounds(one_pass, cfg.topology.plan_rounds, cfg.topology.plan_min_seconds)
        samples = sum(m.num_samples for m in msgs)
        tokens = sum(m.num_tokens for m in msgs)
        backend, variant = trainer.backend, trainer.spec.variant
    finally:
        trainer = msgs = embed = head = None  # free them before the real roles load (one_pass holds a closure)
        if resolve_backend(cfg, device.type) == "flex":
            # the real trainer then compiles (from the inductor cache) as a job without calibration would, and
            # dynamo's per-function recompile limit counts only its own shapes
            torch._dynamo.reset()
        free_memory(device)
    return {**rate_summary(secs, samples, tokens), "steps": len(ks), "samples": samples, "tokens": tokens,
            "warmup_steps": len(warm), "backend": backend, "variant": variant,
            "device": str(device), "dtype": str(dtype).replace("torch.", ""), "messages": ks}
