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

Each side times its batches (steps) ``topology.plan_rounds`` times over, and more rounds until it has timed
``topology.plan_min_seconds``; its rate is the median round's and the rounds' min..max is its spread. The
choice: the fastest split by the median rates, unless a split with fewer targets is a near-tie, i.e. its
predicted rate reaches the fastest split's lowest one (both sides at their slowest round): within the
measurement's noise, the fewest targets win (the drafters are the ranks that train). Exact ties are near-ties.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import os
import statistics
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # annotations only: the split arithmetic (bench/plan_split.py) runs without torch
    import torch


log = logging.getLogger("dflash_dist")


KEY_PREFIX = "dflash/plan/"


MAX_ROUNDS_FACTOR = 10  # plan_min_seconds adds rounds up to this many times plan_rounds


def _spread(name: str, value: float, rng) -> tuple[float, float]:
    if rng is None:
        return value, value
    lo, hi = float(rng[0]), float(rng[1])
    if not (0 < lo <= value <= hi and math.isfinite(hi)):
        raise ValueError(f"{name} spread {rng}: need 0 < min <= {value} (the median) <= max, finite")
    return lo, hi


def choose_split(world_size: int, supply_per_rank: float, demand_per_rank: float,
                 supply_range: Optional[tuple[float, float]] = None,
                 demand_range: Optional[tuple[float, float]] = None, tensor_parallel: int = 1) -> dict:
    """Every split T + D = W with its predicted job rate min(T * supply, D * demand) samples/s, and the chosen
    one: the fastest, unless a split with fewer targets is a near-tie (the drafters are the ranks that train).

    ``supply_range`` / ``demand_range``: the measured (min, max) around each median rate. Each row then also
    has ``samples_per_s_low`` / ``_high`` (both sides at their slowest / fastest round), and a split is a
    near-tie of the fastest when its predicted rate (medians) reaches the fastest split's ``samples_per_s_low``:
    the fewest targets among those is chosen. Without ranges the spread is zero: exact ties go to fewer targets.
    ``tensor_parallel`` k > 1: splits of whole replicas of k ranks (T a multiple of k); ``supply_per_rank`` is then
    a replica's supply / k.

    Returns ``rows`` (one per T: targets, drafters, supply, demand, samples_per_s, per_gpu, bottleneck,
    target_util, drafter_util[, samples_per_s_low, samples_per_s_high]), ``best`` (the chosen row),
    ``target_ranks``, ``drafter_ranks``, ``predicted_samples_per_s``, ``bottleneck`` (the side that sets the
    pace: target, drafter or both), ``fastest_targets`` (T of the fastest row by the medians), ``near_tie``
    (the choice has fewer targets than that), ``continuous_optimum_targets`` (T* = W d / (s + d), where both
    sides balance) and ``ideal_samples_per_s``."""
    w, s, d = int(world_size), float(supply_per_rank), float(demand_per_rank)
    if w < 2:
        raise ValueError(f"world_size={world_size}: a split needs at least 2 ranks (one target, one drafter)")
    if not (s > 0 and d > 0 and math.isfinite(s) and math.isfinite(d)):
        raise ValueError(f"supply {supply_per_rank} and demand {demand_per_rank} must be positive and finite")
    s_lo, s_hi = _spread("supply", s, supply_range)
    d_lo, d_hi = _spread("demand", d, demand_range)
    spread = supply_range is not None or demand_range is not None
    k = int(tensor_parallel)
    if k > 1 and w <= k:
        raise ValueError(f"world_size={world_size}: a replica of {k} ranks leaves no drafter")
    rows = []
    for t in range(k, w, k):  # whole replicas of k ranks; supply_per_rank is then a replica's supply / k
        sup, dem = t * s, (w - t) * d
        rate = min(sup, dem)
        row = {"targets": t, "drafters": w - t, "supply": sup, "demand": dem, "samples_per_s": rate,
               "per_gpu": rate / w,
               "bottleneck": "target" if sup < dem else ("drafter" if dem < sup else "both"),
               "target_util": rate / sup, "drafter_util": rate / dem}
        if spread:
            row.update(samples_per_s_low=min(t * s_lo, (w - t) * d_lo), samples_per_s_high=min(t * s_hi, (w - t) * d_hi))
        rows.append(row)
    fastest = max(rows, key=lambda r: (r["samples_per_s"], -r["targets"]))
    floor = fastest.get("samples_per_s_low", fastest["samples_per_s"])
    best = min((r for r in rows if r["samples_per_s"] >= floor), key=lambda r: r["targets"])
    res = {"world_size": w, "supply_per_rank": s, "demand_per_rank": d, "rows": rows, "best": best,
           "target_ranks": best["targets"], "drafter_ranks": best["drafters"],
           "predicted_samples_per_s": best["samples_per_s"], "bottleneck": best["bottleneck"],
           "fastest_targets": fastest["targets"], "near_tie": best["targets"] < fastest["targets"],
           "continuous_optimum_targets": w * d / (s + d), "ideal_samples_per_s": w * s * d / (s + d)}
    if spread:
        res.update(supply_range=[s_lo, s_hi], demand_range=[d_lo, d_hi])
    return res


def format_splits(res: dict) -> str:
    """The table of one ``choose_split`` result and the choice, as printed by rank 0 and dflash-plan."""
    spread = "samples_per_s_low" in res["rows"][0]
    rng = f" {'spread (min..max)':>19}" if spread else ""
    lines = [f"  {'targets':>7} {'drafters':>8} {'supply':>10} {'demand':>10} {'job samples/s':>13}{rng} "
             f"{'target load':>11} {'drafter load':>12}  bound by"]
    for r in res["rows"]:
        mark = "  <- chosen" if r["targets"] == res["target_ranks"] else ""
        if r["targets"] == res.get("fastest_targets") and res.get("near_tie"):
            mark = "  <- fastest by the medians"
        cell = f" {r['samples_per_s_low']:>9.4g}..{r['samples_per_s_high']:<8.4g}" if spread else ""
        lines.append(f"  {r['targets']:>7} {r['drafters']:>8} {r['supply']:>10.4g} {r['demand']:>10.4g} "
                     f"{r['samples_per_s']:>13.4g}{cell} {100 * r['target_util']:>10.0f}% "
                     f"{100 * r['drafter_util']:>11.0f}%  {r['bottleneck']}{mark}")
    lines.append(f"  chosen: {res['target_ranks']} target + {res['drafter_ranks']} drafter ranks, predicted "
                 f"{res['predicted_samples_per_s']:.4g} samples/s, bottleneck: {res['bottleneck']}")
    if res.get("near_tie"):
        fast = res["rows"][res["fastest_targets"] - 1]
        lines.append(f"  near-tie: {fast['targets']} + {fast['drafters']} predicts {fast['samples_per_s']:.4g} "
                     f"samples/s but as little as {fast['samples_per_s_low']:.4g} within the measured spread, which "
                     f"{res['target_ranks']} + {res['drafter_ranks']} reaches: the fewer targets win")
    return "\n".join(lines)


def _spread_text(m: dict) -> str:
    if "samples_per_s_min" not in m:
        return ""
    med = m["samples_per_s"]
    return (f" [median of {m['rounds']} rounds; min {m['samples_per_s_min']:.4g}, median {med:.4g}, max "
            f"{m['samples_per_s_max']:.4g}: {100 * (m['samples_per_s_min'] / med - 1):+.0f}%/"
            f"{100 * (m['samples_per_s_max'] / med - 1):+.0f}%]")


def format_rates(supply: dict, demand: dict) -> str:
    path = f", {supply['capture']}" if supply.get("capture") else ""  # which capture path was timed
    if supply.get("source") == "--replica-supply":
        head = (f"  target supply  {supply['replica_samples_per_s']:.4g} samples/s per replica of "
                f"{supply['tensor_parallel']} ranks (given with --replica-supply, not measured here)\n")
        return head + format_rates({**supply, "source": None, "tokens_per_s": 0, "batches": 0, "warmup_batches": 0, "seconds": 0,
                                    "device": "-"}, demand).split("\n", 1)[1]
    return (f"  target supply  {supply['samples_per_s']:.4g} samples/s ({supply['tokens_per_s']:.4g} tokens/s) per "
            f"target rank: {supply['batches']} batches timed after {supply['warmup_batches']} warm-up, "
            f"{supply['seconds']:.3g} s on {supply['device']}{path}{_spread_text(supply)}\n"
            f"  drafter demand {demand['samples_per_s']:.4g} samples/s ({demand['tokens_per_s']:.4g} tokens/s) per "
            f"drafter rank: {demand['steps']} steps ({demand['backend']}) timed after {demand['warmup_steps']} "
            f"warm-up, {demand['seconds']:.3g} s on {demand['device']}{_spread_text(demand)}")


def measured_range(m: dict) -> Optional[tuple[float, float]]:
    """(min, max) samples/s of a measurement's rounds (None for one without rounds)."""
    if "samples_per_s_min" not in m:
        return None
    return m["samples_per_s_min"], m["samples_per_s_max"]


def calibration_messages(job, n: int) -> list[int]:
    """Plan indices of the first n messages the job trains (from the resume cursor, wrapping around). Both
    sides measure these, so with plan_target_batches == plan_drafter_steps they time the same samples."""
    return [(job.start_cursor + i) % len(job.plan) for i in range(min(int(n), len(job.plan)))]


def timed_rounds(one_pass, rounds: int, min_seconds: float, clock=time.perf_counter) -> list[float]:
    """Seconds of each call of ``one_pass`` (which syncs the device itself): ``rounds`` calls, then more until
    they add up to ``min_seconds``, at most ``MAX_ROUNDS_FACTOR * rounds`` in all."""
    rounds = max(1, int(rounds))
    secs: list[float] = []
    while len(secs) < rounds or (sum(secs) < min_seconds and len(secs) < MAX_ROUNDS_FACTOR * rounds):
        t0 = clock()
        one_pass()
        secs.append(clock() - t0)
    return secs


def rate_summary(round_seconds: list[float], samples: int, tokens: int) -> dict:
    """One measurement's rates from the seconds of its rounds (each the same ``samples`` / ``tokens``): the median
    round's samples/s and tokens/s, the min and max samples/s."""
    rates = sorted(samples / x for x in round_seconds)
    med = statistics.median(rates)
    return {"samples_per_s": med, "tokens_per_s": med * tokens / samples, "samples_per_s_min": rates[0],
            "samples_per_s_max": rates[-1], "rounds": len(round_seconds), "round_seconds": list(round_seconds),
            "seconds": sum(round_seconds)}


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
    from dflash_dist.data.plan import pad_batch
    from dflash_dist.data.tokenize import TokenizedDataset
    from dflash_dist.model.fast_path import check_target_fast_path
    from dflash_dist.model.hf import build_target_model
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

        def one_pass() -> None:
            for k, m in zip(ks, msgs):
                trainer.train_step(trainer.build(m, k))
            _sync(device)

        secs = timed_rounds(one_pass, cfg.topology.plan_rounds, cfg.topology.plan_min_seconds)
        samples = sum(m.num_samples for m in msgs)
        tokens = sum(m.num_tokens for m in msgs)
        backend = trainer.backend
    finally:
        trainer = msgs = embed = head = None  # free them before the real roles load (one_pass holds a closure)
        if resolve_backend(cfg, device.type) == "flex":
            # the real trainer then compiles (from the inductor cache) as a job without calibration would, and
            # dynamo's per-function recompile limit counts only its own shapes
            torch._dynamo.reset()
        free_memory(device)
    return {**rate_summary(secs, samples, tokens), "steps": len(ks), "samples": samples, "tokens": tokens,
            "warmup_steps": len(warm), "backend": backend,
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
    k = job.cfg.target.tensor_parallel
    # target.tensor_parallel=k: the last k ranks measure as one replica (a group every rank creates, members or not)
    members = list(range(world - k, world))
    if k > 1:
        from datetime import timedelta

        from dflash_dist.model.hf import build_target_replica, random_target_dir
        if world <= k:
            from dflash_dist.config import ConfigError
            raise ConfigError(f"topology.target_ranks=auto: a replica of {k} ranks leaves no drafter in a world of "
                              f"{world}")
        group = dist.new_group(ranks=members, timeout=timedelta(seconds=timeout))
        rdir = os.path.join(random_target_dir(job.run_dir, 0), "plan")

        def build():
            return build_target_replica(job.cfg.target, device.type, group, rdir, build_random=rank == members[0],
                                        ready=(lambda: store.set(KEY_PREFIX + "random_target", "1"),
                                               lambda: store.wait([KEY_PREFIX + "random_target"],
                                                                  timedelta(seconds=timeout))))
        if rank in members[:-1]:
            log.info("topology.target_ranks=auto: measuring the supply of replica %s with rank %d", members,
                     world - 1)
            measure_target_supply(job, device, build=build)
    if rank == world - 1:  # a target in every split
        log.info("topology.target_ranks=auto: measuring target supply on this rank%s",
                 f" (replica {members} of target.tensor_parallel={k})" if k > 1 else "")
        _report(store, "supply", lambda: measure_target_supply(job, device, build=build if k > 1 else None))
    elif rank != 0 and rank not in members:
        log.info("topology.target_ranks=auto: waiting for the measurements of ranks 0 and %d", world - 1)
    if rank != 0:
        # rank 0 waits up to `timeout` for rank W-1 after its own measurement: give it time to say why
        return wait_for(store, "choice", 0, "the chosen split", 2 * timeout)
    try:  # rank 0: a drafter in every split
        log.info("topology.target_ranks=auto: measuring drafter demand on this rank (rank %d measures the target)",
                 world - 1)
        demand = measure_drafter_demand(job, device)
        supply = wait_for(store, "supply", world - 1, "its target supply", timeout)
        if k > 1:  # the replica's rate (and its measured spread), per rank of it, for splits of whole replicas
            per_rank = {key: supply[key] / k for key in ("samples_per_s", "tokens_per_s", "samples_per_s_min",
                                                         "samples_per_s_max") if key in supply}
            supply.update(replica_samples_per_s=supply["samples_per_s"], tensor_parallel=k, **per_rank)
        res = choose_split(world, supply["samples_per_s"], demand["samples_per_s"], measured_range(supply),
                           measured_range(demand), tensor_parallel=k)
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
