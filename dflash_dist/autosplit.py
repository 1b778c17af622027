"""Choosing the target/drafter split from measured rates: ``topology.target_ranks=auto`` and ``dflash-plan``.

A job of W ranks with T targets runs at min(T * supply, (W - T) * demand) samples/s: supply = samples/s one
target rank produces, demand = samples/s one drafter rank trains (the slower side sets the pace; transport is
assumed hidden behind compute, which bench/pipeline.py checks). Both rates are measured with the project's
own code on the job's own data: the target role's model and ``FeatureCapture`` on real batches of the plan,
and ``DrafterTrainer``'s step (alone: no DDP) on the same messages with random features.

* ``topology.target_ranks=auto`` (``train.setup``): rank 0 is a drafter and rank W-1 a target for every
  split, so both measure at the same time on their own devices, without spending a rank on a role it will
  not have; the other ranks wait. The results meet in the rendezvous store (keys ``dflash/plan/*``), rank 0
  picks the split and publishes it, and every rank then builds its role groups. W = 2 has one split (1 + 1)
  and measures nothing.
* ``dflash-plan [--gpus 2,4,8] [--out plan.json] [hydra overrides]``: one process, both measurements one
  after the other on one device, the best split for each W.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # annotations only: the split arithmetic (bench/plan_split.py) runs without torch
    import torch


log = logging.getLogger("dflash_dist")


KEY_PREFIX = "dflash/plan/"


def choose_split(world_size: int, supply_per_rank: float, demand_per_rank: float) -> dict:
    """Every split T + D = W with its predicted job rate min(T * supply, D * demand) samples/s, and the best
    one (ties go to fewer target ranks: the drafters are the ranks that train).

    Returns ``rows`` (one per T: targets, drafters, supply, demand, samples_per_s, per_gpu, bottleneck,
    target_util, drafter_util), ``best`` (its row), ``target_ranks``, ``drafter_ranks``,
    ``predicted_samples_per_s``, ``bottleneck`` (the side that sets the pace: target, drafter or both),
    ``continuous_optimum_targets`` (T* = W d / (s + d), where both sides balance) and ``ideal_samples_per_s``."""
    w, s, d = int(world_size), float(supply_per_rank), float(demand_per_rank)
    if w < 2:
        raise ValueError(f"world_size={world_size}: a split needs at least 2 ranks (one target, one drafter)")
    if not (s > 0 and d > 0 and math.isfinite(s) and math.isfinite(d)):
        raise ValueError(f"supply {supply_per_rank} and demand {demand_per_rank} must be positive and finite")
    rows = []
    for t in range(1, w):
        sup, dem = t * s, (w - t) * d
        rate = min(sup, dem)
        rows.append({"targets": t, "drafters": w - t, "supply": sup, "demand": dem, "samples_per_s": rate,
                     "per_gpu": rate / w,
                     "bottleneck": "target" if sup < dem else ("drafter" if dem < sup else "both"),
                     "target_util": rate / sup, "drafter_util": rate / dem})
    best = max(rows, key=lambda r: (r["samples_per_s"], -r["targets"]))
    return {"world_size": w, "supply_per_rank": s, "demand_per_rank": d, "rows": rows, "best": best,
            "target_ranks": best["targets"], "drafter_ranks": best["drafters"],
            "predicted_samples_per_s": best["samples_per_s"], "bottleneck": best["bottleneck"],
            "continuous_optimum_targets": w * d / (s + d), "ideal_samples_per_s": w * s * d / (s + d)}


def format_splits(res: dict) -> str:
    """The table of one ``choose_split`` result and the choice, as printed by rank 0 and dflash-plan."""
    lines = [f"  {'targets':>7} {'drafters':>8} {'supply':>10} {'demand':>10} {'job samples/s':>13} "
             f"{'target load':>11} {'drafter load':>12}  bound by"]
    for r in res["rows"]:
        mark = "  <- chosen" if r["targets"] == res["target_ranks"] else ""
        lines.append(f"  {r['targets']:>7} {r['drafters']:>8} {r['supply']:>10.4g} {r['demand']:>10.4g} "
                     f"{r['samples_per_s']:>13.4g} {100 * r['target_util']:>10.0f}% {100 * r['drafter_util']:>11.0f}%"
                     f"  {r['bottleneck']}{mark}")
    lines.append(f"  chosen: {res['target_ranks']} target + {res['drafter_ranks']} drafter ranks, predicted "
                 f"{res['predicted_samples_per_s']:.4g} samples/s, bottleneck: {res['bottleneck']}")
    return "\n".join(lines)


def format_rates(supply: dict, demand: dict) -> str:
    path = f", {supply['capture']}" if supply.get("capture") else ""  # which capture path was timed
    return (f"  target supply  {supply['samples_per_s']:.4g} samples/s ({supply['tokens_per_s']:.4g} tokens/s) per "
            f"target rank: {supply['batches']} batches timed after {supply['warmup_batches']} warm-up, "
            f"{supply['seconds']:.3g} s on {supply['device']}{path}\n"
            f"  drafter demand {demand['samples_per_s']:.4g} samples/s ({demand['tokens_per_s']:.4g} tokens/s) per "
            f"drafter rank: {demand['steps']} steps ({demand['backend']}) timed after {demand['warmup_steps']} "
            f"warm-up, {demand['seconds']:.3g} s on {demand['device']}")


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


def measure_target_supply(job, device: torch.device, batches: Optional[int] = None) -> dict:
    """Samples/s and tokens/s of one target rank: the target built as ``target.loop.run_target`` builds it
    (same loader / random init, fast-path policy, ``build_capture``: the same packing, compile and padding),
    run on the plan's messages exactly as the target loop batches them (pad_batch + capture + device sync, what it
    counts as busy), after warm-up: 1 batch, or with anything compiled (packing, target.compile) one pass over
    the measured batches, so no compile lands in the timed ones."""
    from dflash_dist.data.plan import pad_batch
    from dflash_dist.data.tokenize import TokenizedDataset
    from dflash_dist.model.fast_path import check_target_fast_path
    from dflash_dist.model.hf import build_target_model
    from dflash_dist.target.capture import build_capture
    cfg = job.cfg
    ks = calibration_messages(job, batches or cfg.topology.plan_target_batches)
    t0 = time.monotonic()
    model = build_target_model(cfg.target, device.type)
    build_s = time.monotonic() - t0
    check_target_fast_path(model, cfg.target.fast_path, device.type)  # never time a refused fallback path
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    capture = build_capture(cfg.target, model, job.layer_ids, device.type)
    packed, compiled = capture.packing, capture.compile
    path = capture.describe()
    warmup = ks if (packed or compiled) else ks[:1]  # allocator, kernels, caches; compiles: every shape
    ds = TokenizedDataset.load(job.dataset_path)
    samples = tokens = 0
    try:
        for i, k in enumerate(warmup + ks):
            if i == len(warmup):
                t0 = time.perf_counter()
            ids, lengths, _, _ = pad_batch([ds[j] for j in job.plan[k]], device, packed)
            capture(ids, lengths)
            _sync(device)
            if i >= len(warmup):
                samples, tokens = samples + len(lengths), tokens + int(lengths.sum())
        secs = time.perf_counter() - t0
    finally:
        capture.close()
        del capture, model
        free_memory(device)
    return {"samples_per_s": samples / secs, "tokens_per_s": tokens / secs, "batches": len(ks), "samples": samples,
            "tokens": tokens, "seconds": secs, "warmup_batches": len(warmup), "build_s": build_s,
            "device": str(device), "dtype": dtype, "messages": ks, "capture": path}


def measure_drafter_demand(job, device: torch.device, steps: Optional[int] = None) -> dict:
    """Samples/s of one drafter rank: ``DrafterTrainer`` built as the drafter role builds it (model config,
    backend, optimizer, compile settings and guard), alone (no DDP), with a random frozen embedding / lm_head of
    the target's shape and dtype; its full step (``build``: make_batch; ``train_step``: mask, forward,
    decayed CE, backward, clip, AdamW) on the plan's messages (real lengths and loss masks, random features of
    width n_layers * H in the target dtype), after warm-up: one step, or with flex one per batch shape timed
    (so no compile lands in the timed steps)."""
    import torch

    from dflash_dist.comm.distributed import Dist
    from dflash_dist.comm.topology import Topology
    from dflash_dist.comm.transport import Message
    from dflash_dist.config import resolve_backend
    from dflash_dist.data.plan import pad_batch
    from dflash_dist.data.tokenize import TokenizedDataset
    from dflash_dist.drafter.trainer import DrafterTrainer
    from dflash_dist.model.hf import resolve_dtype, text_config
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
        t0 = time.perf_counter()
        for k, m in zip(ks, msgs):
            trainer.train_step(trainer.build(m, k))
        _sync(device)
        secs = time.perf_counter() - t0
        samples = sum(m.num_samples for m in msgs)
        tokens = sum(m.num_tokens for m in msgs)
        backend = trainer.backend
    finally:
        del trainer, msgs, embed, head
        if resolve_backend(cfg, device.type) == "flex":
            # the real trainer then compiles (from the inductor cache) as a job without calibration would, and
            # dynamo's per-function recompile limit counts only its own shapes
            torch._dynamo.reset()
        free_memory(device)
    return {"samples_per_s": samples / secs, "tokens_per_s": tokens / secs, "steps": len(ks), "samples": samples,
            "tokens": tokens, "seconds": secs, "warmup_steps": len(warm), "backend": backend,
            "device": str(device), "dtype": str(dtype).replace("torch.", ""), "messages": ks}


def _report(store, name: str, fn) -> dict:
    """Run a measurement and post its result (or its error, so the reader fails now instead of at a timeout)."""
    try:
        value = fn()
    except BaseException as e:
        store.set(KEY_PREFIX + name, json.dumps({"error": f"{type(e).__name__}: {e}"}))
        raise
    store.set(KEY_PREFIX + name, json.dumps(value))
    return value


def wait_for(store, name: str, rank: int, what: str, timeout_s: float) -> dict:
    """The value rank ``rank`` posted under ``dflash/plan/<name>``; a clear error naming that rank if it posted
    an error or nothing within ``timeout_s``."""
    try:
        store.wait([KEY_PREFIX + name], timedelta(seconds=timeout_s))
    except Exception as e:  # the store's timeout (DistStoreError) or a lost store
        raise RuntimeError(f"topology.target_ranks=auto: rank {rank} did not report {what} within {timeout_s:.0f} s "
                           f"(topology.warmup_timeout_s): {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                           ) from e
    value = json.loads(store.get(KEY_PREFIX + name))
    if "error" in value:
        raise RuntimeError(f"topology.target_ranks=auto: rank {rank} failed while measuring {what}: {value['error']}")
    return value


def write_plan_json(path: str, res: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, path)


def auto_split(job, rank: int, world: int, device: torch.device) -> dict:
    """``topology.target_ranks=auto`` on every rank of the job (after the data plan, before the role groups):
    returns the same dict on every rank (``target_ranks`` is the split); rank 0 logs it and writes plan.json."""
    timeout = job.cfg.topology.warmup_timeout_s
    if world == 2:
        res = {"world_size": 2, "target_ranks": 1, "drafter_ranks": 1, "measured": False,
               "note": "2 ranks have one split (1 target + 1 drafter): nothing measured"}
        if rank == 0:
            log.info("topology.target_ranks=auto: %s", res["note"])
            write_plan_json(os.path.join(job.run_dir, "plan.json"), res)
        return res
    import torch.distributed as dist
    store = dist.distributed_c10d._get_default_store()
    t0 = time.monotonic()
    if rank == world - 1:  # a target in every split
        log.info("topology.target_ranks=auto: measuring target supply on this rank")
        _report(store, "supply", lambda: measure_target_supply(job, device))
    elif rank != 0:
        log.info("topology.target_ranks=auto: waiting for the measurements of ranks 0 and %d", world - 1)
    if rank != 0:
        # rank 0 waits up to `timeout` for rank W-1 after its own measurement: give it time to say why
        return wait_for(store, "choice", 0, "the chosen split", 2 * timeout)
    try:  # rank 0: a drafter in every split
        log.info("topology.target_ranks=auto: measuring drafter demand on this rank (rank %d measures the target)",
                 world - 1)
        demand = measure_drafter_demand(job, device)
        supply = wait_for(store, "supply", world - 1, "its target supply", timeout)
        res = choose_split(world, supply["samples_per_s"], demand["samples_per_s"])
        res.update(measured=True, measured_on={"drafter": 0, "target": world - 1}, supply=supply, demand=demand,
                   calibration_s=time.monotonic() - t0)
    except BaseException as e:
        store.set(KEY_PREFIX + "choice", json.dumps({"error": f"rank 0: {type(e).__name__}: {e}"}))
        raise
    store.set(KEY_PREFIX + "choice", json.dumps(res))
    log.info("topology.target_ranks=auto: measured in %.1f s (drafter demand on rank 0, target supply on rank %d)\n"
             "%s\n%s", res["calibration_s"], world - 1, format_rates(supply, demand), format_splits(res))
    write_plan_json(os.path.join(job.run_dir, "plan.json"), res)
    return res
