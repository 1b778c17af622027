"""The two rates a split is chosen from, measured with the job's own code on its own data: one target rank's supply
(the target as ``target.loop.run_target`` builds it, on the plan's batches) and one drafter rank's demand
(``DrafterTrainer``'s step, alone, on the same messages with random features)."""

from __future__ import annotations

import dataclasses
import gc
import logging
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


def measure_target_supply(job, device: torch.device, batches: Optional[int] = None, build=None, group=None) -> dict:
    """Samples/s and tokens/s of one target rank: the target built as ``target.loop.run_target`` builds it
    (same loader / random init, fast-path policy, ``build_capture``: the same packing, compile and padding),
    run on the plan's messages exactly as the target loop batches them (pad_batch + capture + device sync, what it
    counts as busy), after a warm-up pass over the measured batches (allocator, kernels, caches, and every
    compile of packing or target.compile), so the timed rounds are steady state. The batches are timed in rounds
    (``timed_rounds``: topology.plan_rounds, plan_min_seconds); ``samples``/``tokens`` are one round's.
    ``build``: a callable returning the model (a rank's shard of a replica: every rank of the replica runs this
    together, and the rate is the replica's); ``group``: that replica's process group, over which its ranks agree
    on the number of timed rounds (their forwards are collectives)."""
    from dflash_dist.comm.distributed import any_rank
    from dflash_dist.data.tokenize import TokenizedDataset
    from dflash_dist.targets.fast_path import check_target_fast_path
    from dflash_dist.targets.hf import build_target_model
    from dflash_dist.roles.target_rank.batch import pad_batch
    from dflash_dist.roles.target_rank.capture import build_capture
    cfg = job.cfg
    ks = calibration_messages(job, batches or cfg.topology.plan_target_batches)
    t0 = time.monotonic()
    model = build() if build is not None else build_target_model(cfg.target, device.type)
    build_s = time.monotonic() - t0
    check_target_fast_path(model, cfg.target.fast_path, device.type)  # never time a refused fallback path
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    capture = build_capture(cfg.target, model, job.layer_ids, device.type)
    packed = capture.packing
    path = capture.describe()
    warmup = ks  # allocator, kernels, caches per shape; compiles: every shape
    ds = TokenizedDataset.load(job.dataset_path)
    counts = []

    def run(batch_keys) -> None:
        samples = tokens = 0
        for k in batch_keys:
            ids, lengths, _, _ = pad_batch([ds[j] for j in job.plan[k]], device, packed)
            capture.for_loss(ids, lengths, job.drafter.loss)  # labels=target: the whole model and its lm_head
            _sync(device)
            samples, tokens = samples + len(lengths), tokens + int(lengths.sum())
        counts.append((samples, tokens))

    try:
        run(warmup)
        secs = timed_rounds(lambda: run(ks), cfg.topology.plan_rounds, cfg.topology.plan_min_seconds,
                            agree=None if group is None else lambda more: any_rank(more, group, device))
    finally:
        capture.close()
        capture = model = None  # freed before the real roles load (run() holds a closure)
        free_memory(device)
    samples, tokens = counts[-1]  # every round the same batches
    return {**rate_summary(secs, samples, tokens), "batches": len(ks), "samples": samples, "tokens": tokens,
            "warmup_batches": len(warmup), "build_s": build_s, "device": str(device), "dtype": dtype,
            "messages": ks, "capture": path}


def random_head_weights(job, device: torch.device) -> tuple:
    """A frozen embedding and lm_head of the target's shape and dtype, random (seeded by target.init_seed): what a
    drafter alone trains with in place of the target's (the step's cost is the same)."""
    import torch

    from dflash_dist.targets.hf import resolve_dtype, text_config
    tc = text_config(job.hf_config)
    dtype = resolve_dtype(job.cfg.target.dtype, device.type)
    g = torch.Generator(device=device).manual_seed(job.cfg.target.init_seed)
    return tuple((torch.randn(tc.vocab_size, tc.hidden_size, generator=g, device=device) * 0.02).to(dtype)
                 for _ in range(2))


def plan_message(job, ds, k: int, features, src: int):
    """Message k of the plan as the transport delivers it to a drafter: token ids, loss mask and features on the
    features' device, cu_seqlens on the host. ``features``: a callable from the message's token count to the
    features [tokens, n_layers * H]."""
    from dflash_dist.comm.transport import Message
    from dflash_dist.roles.target_rank.batch import pad_batch
    _, lengths, ids, mask = pad_batch([ds[i] for i in job.plan[k]], "cpu")
    feats = features(int(lengths.sum()))
    return Message.build(k, job.plan[k], Message.cu_of(lengths), ids.to(feats.device), mask.to(feats.device),
                         feats, src=src)


def measure_drafter_demand(job, device: torch.device, steps: Optional[int] = None, group=None) -> dict:
    """Samples/s of one drafter rank: ``DrafterTrainer`` built as the drafter role builds it (model config,
    backend, optimizer, compile settings and guard), alone (no DDP), with a random frozen embedding / lm_head of
    the target's shape and dtype; its full step (``build``: make_batch; ``train_step``: mask, forward,
    decayed CE, backward, clip, AdamW) on the plan's messages (real lengths and loss masks, random features of
    width n_layers * H in the target dtype), after a warm-up pass over the same messages (every batch shape
    once: no compile, first allocation or kernel choice lands in the timed steps). The steps are timed in rounds (``timed_rounds``:
    topology.plan_rounds, plan_min_seconds); ``samples``/``tokens`` are one round's. ``group``: the drafter ranks
    measuring together (every rank of it calls this): the trainer is data-parallel over it as the job's drafters are
    (DDP's gradient all-reduce and the step's weight-sum all-reduce in every step), and its ranks agree on the
    number of timed rounds; the rate is one rank's."""
    import torch
    import torch.distributed as dist

    from dflash_dist.comm.distributed import Dist, any_rank
    from dflash_dist.comm.topology import Topology
    from dflash_dist.config import resolve_backend
    from dflash_dist.data.tokenize import TokenizedDataset
    from dflash_dist.roles.drafter_rank.trainer import DrafterTrainer
    from dflash_dist.targets.hf import text_config
    cfg = job.cfg
    ks = calibration_messages(job, steps or cfg.topology.plan_drafter_steps)
    embed, head = random_head_weights(job, device)
    dtype = embed.dtype
    # one target feeding the measuring drafters; drafters=None (one drafter) is the trainer's "alone" mode
    size = 1 if group is None else dist.get_world_size(group)
    index = 0 if group is None else dist.get_rank(group)
    alone = Dist(topo=Topology(size + 1, index, 1), device=device, ctrl=None, data=None,
                 drafters=group if size > 1 else None, store=None)
    ds = TokenizedDataset.load(job.dataset_path)
    width = len(job.layer_ids) * text_config(job.hf_config).hidden_size
    fg = torch.Generator(device=device).manual_seed(0)

    def message(k: int):
        return plan_message(job, ds, k, lambda t: torch.randn(t, width, generator=fg, device=device).to(dtype),
                            src=alone.topo.target_ranks[0])

    trainer = msgs = None
    try:
        trainer = DrafterTrainer(dataclasses.replace(job, dist=alone, resume_from=None, auto_split=None),
                                 head_weights=(embed, head))
        msgs = [message(k) for k in ks]  # built before the clock starts: the real drafter receives them ready
        warm = list(zip(ks, msgs))  # steady state: the timed rounds repeat a pass the trainer has run
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

        secs = timed_rounds(one_pass, cfg.topology.plan_rounds, cfg.topology.plan_min_seconds,
                            agree=None if size == 1 else lambda more: any_rank(more, group, device))
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
            "warmup_steps": len(warm), "backend": backend, "variant": variant, "data_parallel_ranks": size,
            "device": str(device), "dtype": str(dtype).replace("torch.", ""), "messages": ks}
