"""Drafter rank: receive features, build blocks and masks, train the DFlash drafter data-parallel.

Every drafter takes the same number of optimizer steps (a drafter with no message in the last step joins
with an empty batch). The loss is normalised by the *global* weight sum (one all-reduce, no host sync),
so every supervised slot counts the same whichever drafter trained it.
"""

from __future__ import annotations

import json
import logging
import os
import time

import torch
import torch.distributed as dist

from dflash_dist.comm.distributed import shorten_timeouts
from dflash_dist.comm.faults import fault_for, stall_if_due
from dflash_dist.comm.head_offload import HeadLossClient, head_channels
from dflash_dist.comm.transport import EndOfStream, Receiver, job_channel
from dflash_dist.drafter.compile_guard import batch_shape, dynamo_counters, report_graph_breaks
from dflash_dist.drafter.startup_report import host_syncs, startup_report
from dflash_dist.drafter.trainer import LEAKY_MASK_ENV, DrafterTrainer
from dflash_dist.eval.in_training import LeaderEval, eval_enabled, eval_record, eval_steps
from dflash_dist.telemetry.flops import nominal_peak_tflops
from dflash_dist.telemetry.metrics import MetricsWriter, RateMeter, StreamWaitMeter, target_window_metrics
from dflash_dist.telemetry.step_trace import format_timeline, traced_step

log = logging.getLogger("dflash_dist")


def drain(rx, topo, pending, ends_seen: set, target_stats: dict) -> int:
    """Receive (and drop) whatever the targets still send until each has said END; returns samples dropped.
    Used after a graceful stop: those samples were not trained and stay in the untrained part of the plan."""
    dropped = 0
    got = pending.complete() if pending is not None else None
    for t in topo.target_ranks:
        while t not in ends_seen:
            if got is None:
                got = rx.post(t).complete()
            if isinstance(got, EndOfStream):
                ends_seen.add(got.src)
                target_stats[got.src] = got.sender_stats
            else:
                dropped += got.num_samples
            got = None
    return dropped


SYNC_CHECK_STEP = 3  # the step run under CUDA's sync debug mode (after the guard's warm-up steps)


def profiled_step(trainer, batch, first_step_s, job) -> None:
    """Train one step under the profiler: the startup report (backend that ran, memory, compile and caches),
    printed by the leader and written to <run_dir>/startup_report.json; graph breaks named."""
    topo, device = job.dist.topo, job.dist.device
    b_, s_pad, q_len = batch_shape(batch)
    q_len //= trainer.micro_batches  # the queries of one forward
    rep = startup_report(lambda: trainer.train_step(batch), trainer.model,
                         {"b": b_, "S_pad": s_pad, "Q": q_len, "first_step_s": first_step_s, "guard": trainer.guard,
                          "precompile_s": trainer.precompile_s},
                         device, print_fn=log.info if topo.is_leader else log.debug)
    if topo.is_leader:
        with open(os.path.join(job.run_dir, "startup_report.json"), "w") as f:
            json.dump(rep, f, indent=1, default=str)
    breaks = report_graph_breaks(raise_on_break=False)
    if breaks:
        log.warning("graph breaks in compiled regions: %s", list(breaks)[:5])


def trace_step(trainer, batch, s: int, job) -> None:
    """logging.debug.profile_step: train step ``s`` under torch.profiler, write its Chrome trace to
    <run_dir>/profile/drafter_rank<r>_step<s>.json and log its phase timeline (step_trace.timeline)."""
    r = job.dist.rank
    path = os.path.join(job.run_dir, "profile", f"drafter_rank{r}_step{s}.json")
    tl, _ = traced_step(lambda: trainer.train_step(batch), path, job.dist.device)
    log.info("%s\ntrace: %s", format_timeline(tl, f"drafter rank {r}, step {s} (traced alone: "
                                                  "device synchronized before and after)"), path)


def log_host_syncs(step_fn, step: int, device) -> None:
    """Build and train one step under CUDA's sync debug mode and name every host sync it made (none expected:
    each one makes the host wait for the queued step, and for the receive it waits on, before queuing more)."""
    _, syncs = host_syncs(step_fn, device)
    if syncs is None:  # CPU: nothing to check
        return
    where = f" at {', '.join(sorted(set(syncs)))}" if syncs else ""
    (log.warning if syncs else log.info)("host syncs in one training step (step %d, CUDA sync debug mode): %d%s",
                                         step, len(syncs), where)


def run_drafter(job) -> None:
    cfg, d = job.cfg, job.dist
    topo = d.topo
    life = job.life
    trainer = DrafterTrainer(job)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    if trainer.leaky_mask:
        log.warning("%s=1: training with the LEAKY mask (kv <= anchor) on purpose (a demonstration, never use it)",
                    LEAKY_MASK_ENV)
    flex_desc = (f" (compiled flex_attention, {'dynamic' if trainer.flex_dynamic else 'static'} shapes"
                 f"{', compiled layers' if trainer.compile_layers else ''}"
                 f"{', compiled loss' if trainer.compile_loss else ''}"
                 f"{', kernel options ' + str(cfg.drafter.tuning.flex_kernel_options) if cfg.drafter.tuning.flex_kernel_options else ''})")
    log.info("drafter: %d layers, %.2fM trainable params, attention backend=%s%s, anchors=%d, block=%d",
             cfg.drafter.num_layers, n_params / 1e6, trainer.backend,
             flex_desc if trainer.backend == "flex" else " (dense bool mask, SDPA)",
             cfg.drafter.num_anchors, cfg.drafter.block_size)
    run_messages = job.total_messages - job.start_cursor
    steps = topo.num_steps(run_messages)
    total_steps = job.start_step + steps
    writer = MetricsWriter(job.run_dir, cfg.to_dict(), cfg.logging.wandb, total_steps, topo.is_leader,
                           cfg.logging.progress_bar)
    if job.auto_split is not None:  # topology.target_ranks=auto: the measured rates and the split, once
        from dflash_dist.telemetry.plan_record import plan_record
        writer.log(job.start_step, plan_record(job.auto_split), kind="plan")
    channel = job_channel(d, cfg.topology, check=life.check, serve_heads=cfg.drafter.tuning.loss_on_target)
    channel.connect(topo.target_ranks, sending=False)  # before any payload: see Channel.connect
    head_channel = None
    if cfg.drafter.tuning.loss_on_target:
        head_channel, reply_channel = head_channels(d, cfg.topology.warmup_timeout_s, life.check, topo.target_ranks,
                                                    drafter=True)
        trainer.heads = HeadLossClient(head_channel, reply_channel, d.rank, trainer.lm_head.dtype,
                                       cfg.drafter.block_size, cfg.drafter.gamma)
    if trainer.micro_batches > 1 or head_channel is not None:
        served = trainer.micro_batches - cfg.drafter.tuning.local_loss_groups
        log.info("drafter step: %d group(s) of %d anchors, each its own forward; lm_head and loss %s",
                 trainer.micro_batches, cfg.drafter.num_anchors // trainer.micro_batches,
                 f"of {served} group(s) on the target that sent the message (drafter.tuning.loss_on_target), of "
                 f"{cfg.drafter.tuning.local_loss_groups} on this rank" if head_channel is not None else "on this rank")
    rx = Receiver(channel, d.rank)
    mine = list(topo.drafter_messages(run_messages))
    pending = rx.post(topo.target_for(mine[0]), job.start_cursor + mine[0]) if mine else None
    rate = RateMeter()
    bytes_seen = 0
    peak = cfg.logging.peak_tflops or nominal_peak_tflops(d.device)  # None on CPU: no MFU metrics
    target_stats, prev_target_stats = {}, {}
    ends_seen: set = set()
    wait_s = busy_s = 0.0
    seen_time = (0.0, 0.0, 0.0, 0.0)  # (wait, busy, wall, stream wait) at the last logged window: per window
    stream_wait = StreamWaitMeter(d.device)
    stopped = False
    stop_at = None
    sample_log = None
    if cfg.logging.debug.record_sample_ids:
        os.makedirs(os.path.join(job.run_dir, "sample_log"), exist_ok=True)
        sample_log = open(os.path.join(job.run_dir, "sample_log", f"rank{d.rank}.jsonl"), "a", buffering=1)
    fault = fault_for(d.rank)  # failure tests only
    leader_eval = LeaderEval(job, trainer.model) if eval_enabled(job) and topo.is_leader else None
    eval_at = set(eval_steps(job)) if leader_eval is not None else set()
    last_window = None
    t_start = time.monotonic()
    if trainer.precompile_plan:
        took = trainer.precompile()  # the compiles of the planned shapes now, not when training reaches them
        log.info("precompiled %d planned batch shapes in %.1f s before training (dry steps, nothing updated): %s",
                 len(trainer.precompile_plan), took,
                 ", ".join(f"{len(x)} sample(s) up to {max(x)} tokens" for x in trainer.precompile_plan))
    first_step_s = None
    for s in range(steps):
        j = s * topo.num_drafters + topo.index
        t0 = time.monotonic()
        msg = None
        if j < run_messages:
            before = stream_wait.mark()
            msg = pending.complete()
            stream_wait.add(before, stream_wait.mark())
            pending = None
            if isinstance(msg, EndOfStream):
                raise RuntimeError(f"target rank {msg.src} ended its stream before message {job.start_cursor + j}")
            target_stats[msg.src] = msg.sender_stats
            trainer.counts["messages_received"] += 1
            trainer.counts["samples_received"] += msg.num_samples
            nxt = j + topo.num_drafters
            if nxt < run_messages:
                pending = rx.post(topo.target_for(nxt), job.start_cursor + nxt)
        t1 = time.monotonic()
        k = job.start_cursor + j
        stall_if_due(fault, s)
        if s == 1:  # one profiled step after the warm-up step: what really ran, memory, compile/cache
            profiled_step(trainer, trainer.build(msg, k), first_step_s, job)
        elif s == SYNC_CHECK_STEP:  # after warm-up: does a step make the host wait for the GPU?
            log_host_syncs(lambda: trainer.train_step(trainer.build(msg, k)), trainer.step, d.device)
        elif s == cfg.logging.debug.profile_step:  # a step's phases on the GPU timeline, asked for
            trace_step(trainer, trainer.build(msg, k), s, job)
        else:
            trainer.train_step(trainer.build(msg, k))
        if s == 0:
            first_step_s = time.monotonic() - t1
        if msg is not None:
            rate.add(msg.num_samples, msg.num_tokens)
            if sample_log is not None:
                sample_log.write(json.dumps({"k": msg.index, "step": trainer.step, "ids": msg.sample_ids.tolist()})
                                 + "\n")
        else:
            trainer.counts["empty_steps"] += 1
        trainer.step += 1
        trainer.cursor = min(job.start_cursor + (s + 1) * topo.num_drafters, job.total_messages)
        wait_s += t1 - t0
        busy_s += time.monotonic() - t1
        if s == 1:
            channel.timeout_s = cfg.topology.timeout_s
            if head_channel is not None:
                head_channel.timeout_s = reply_channel.timeout_s = cfg.topology.timeout_s
            shorten_timeouts(d, cfg.topology.timeout_s)
        last = s == steps - 1
        # graceful stop: the leader fixes a step two ahead; drafters are in lockstep (DDP), so all see it in time
        requested = life.stop_requested()  # posts this rank's own signal, if it got one
        if topo.is_leader and stop_at is None and requested:
            stop_at = trainer.step + 2
            life.announce_stop(stop_at)
        if stop_at is None:
            stop_at = life.stop_step()
        stop_now = stop_at is not None and trainer.step >= stop_at and not last
        first = s == 0  # the first step is always logged: the start of the loss curve
        if trainer.step % cfg.logging.log_every == 0 or last or stop_now or first:
            window = trainer.read_window()  # all drafters: one all-reduce per window
            if trainer.guard is not None:
                dc = dynamo_counters()
                window.update({f"compile/{k}": dc[k] for k in ("unique_graphs", "graph_breaks", "recompiles")})
            r = rate.take()
            link_bps = (rx.bytes_received - bytes_seen) / r["window_s"]
            bytes_seen = rx.bytes_received
            rates = torch.tensor([r["samples_per_s"], r["tokens_per_s"], link_bps], dtype=torch.float64,
                                 device=d.device)
            dist.all_reduce(rates, group=d.drafters)  # job throughput = sum over drafters
            sps, tps, link = rates.tolist()
            wall = time.monotonic() - t_start
            dwall = max(wall - seen_time[2], 1e-9)
            stream_wait_s = stream_wait.seconds()
            window.update({"samples_per_s": sps, "tokens_per_s": tps, "link_gb_per_s": link / 1e9,
                           "drafter_samples_per_s": sps / topo.num_drafters,
                           "drafter_wait_frac": (wait_s - seen_time[0]) / dwall,
                           "drafter_busy_frac": (busy_s - seen_time[1]) / dwall,
                           "drafter_stream_wait_frac": (stream_wait_s - seen_time[3]) / dwall,
                           "epoch_progress": trainer.cursor / max(job.total_messages, 1)})
            if peak:  # model FLOPs of all drafters over the window / (drafters x window x peak)
                window["drafter_mfu"] = window["model_flops"] / (topo.num_drafters * r["window_s"] * peak * 1e12)
            window.update(target_window_metrics(target_stats, prev_target_stats, peak))
            prev_target_stats = dict(target_stats)
            seen_time = (wait_s, busy_s, wall, stream_wait_s)
            last_window = window
            if leader_eval is not None:
                for at, res in leader_eval.ready():
                    writer.log(at, eval_record(res, last_window), kind="eval")
            if topo.is_leader:
                writer.log(trainer.step, window)
                writer.progress(trainer.step, {"loss": f"{window['loss']:.3f}", "acc": f"{window['acc']:.3f}",
                                               "samples/s": f"{window['samples_per_s']:.1f}"})
                if not cfg.logging.progress_bar:
                    log.info("step %d/%d loss %.4f acc %.3f lr %.2e %.1f samples/s", trainer.step, total_steps,
                             window["loss"], window["acc"], window["lr"], window["samples_per_s"])
        if leader_eval is not None:
            leader_eval.pump()  # the weights of a requested evaluation, once the target has posted their receive
            if trainer.step in eval_at:
                leader_eval.request(trainer.step)
        if stop_now:
            stopped = True
            break
        if cfg.train.checkpoint_every and trainer.step % cfg.train.checkpoint_every == 0 and not last:
            trainer.save()
    if stopped:
        if leader_eval is not None:
            leader_eval.close()
        # samples of messages after the cursor were not trained: the checkpoint's cursor excludes them
        trainer.save(final=False, reason="signal")
        if topo.is_leader:
            log.warning("stopped on request after step %d; resume with train.resume=auto", trainer.step)
        dropped = drain(rx, topo, pending, ends_seen, target_stats)
        trainer.counts["samples_dropped_after_stop"] = dropped
    else:
        for t in topo.target_ranks:  # every target says END once its share is sent
            end = rx.post(t).complete()
            if not isinstance(end, EndOfStream):
                raise RuntimeError(f"expected END from target rank {t}, got message {end.index}")
            ends_seen.add(t)
            target_stats[t] = end.sender_stats
        trainer.save(final=True)
    if leader_eval is not None and not stopped:
        for at, res in leader_eval.ready(block_s=cfg.topology.warmup_timeout_s):
            rec = eval_record(res, last_window)
            writer.log(at, rec, kind="eval")
            log.info("acceptance at step %d: tau %.3f (z-lab: mean over prompts), pooled %.3f (training accuracy "
                     "predicts %.3f) on %d held-out prompts", at, rec["tau"] or float("nan"),
                     rec.get("tau_pooled") or float("nan"), rec.get("tau_from_train_acc") or float("nan"),
                     rec["n_prompts"])
    accounting = account(trainer, d, target_stats, stopped)
    if topo.is_leader:
        writer.log(trainer.step, accounting, kind="accounting")
        log.info("%s: %d steps, %d of %d messages trained in %.1f s; samples %s", "stopped" if stopped else "done",
                 trainer.step, trainer.cursor, job.total_messages, time.monotonic() - t_start,
                 {k: int(v) for k, v in accounting.items()})
    writer.close()


def account(trainer, d, target_stats: dict, stopped: bool) -> dict:
    """Job-wide sample accounting (all drafters): received = trained + skipped (+ dropped after a stop)."""
    c = trainer.counts
    keys = ["samples_received", "samples_skipped_shape", "samples_dropped_after_stop", "messages_received"]
    v = torch.tensor([float(c.get(k, 0)) for k in keys], dtype=torch.float64, device=d.device)
    dist.all_reduce(v, group=d.drafters)
    out = dict(zip(keys, v.tolist()))
    out["samples_skipped_nonfinite"] = float(sum(trainer.nonfinite_by_target))
    out["samples_trained"] = (out["samples_received"] - out["samples_skipped_shape"]
                              - out["samples_skipped_nonfinite"])
    # what the targets sent = what drafters took for training + what they dropped after a graceful stop
    out["samples_sent"] = float(sum(st[3] for st in target_stats.values() if st))
    return out
