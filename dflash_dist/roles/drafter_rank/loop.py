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

from dflash_dist.checkpoint.resume import record_dropped, run_totals
from dflash_dist.comm.distributed import shorten_timeouts
from dflash_dist.comm.faults import fault_for, stall_if_due
from dflash_dist.comm.head_offload import HeadLossClient, head_channels, head_servers
from dflash_dist.comm.transport import EndOfStream, Receiver, job_channel
from dflash_dist.roles.drafter_rank.compile_guard import dynamo_counters, report_graph_breaks
from dflash_dist.roles.drafter_rank.shape_plan import batch_shape
from dflash_dist.roles.drafter_rank.startup_report import host_syncs, startup_report
from dflash_dist.roles.drafter_rank.trainer import LEAKY_MASK_ENV, DrafterTrainer
from dflash_dist.eval.in_training import LeaderEval, eval_enabled, eval_record, eval_steps
from dflash_dist.targets.families import text_config
from dflash_dist.planning.memory import plan_rank, plan_steps
from dflash_dist.role_jobs import DrafterJob
from dflash_dist.storage import writing
from dflash_dist.telemetry.flops import nominal_peak_tflops, target_peak_tflops
from dflash_dist.telemetry.memory_peak import PeakMemory
from dflash_dist.telemetry.metrics import MetricsWriter, RateMeter, StreamWaitMeter, run_summary, target_window_metrics
from dflash_dist.telemetry.plan_check import plan_check_for, plan_line
from dflash_dist.telemetry.step_trace import format_timeline, traced_step

log = logging.getLogger("dflash_dist")


def drain(rx, topo, pending, ends_seen: set, target_stats: dict) -> int:
    """Receive (and drop) whatever the targets still send until each has said END; returns samples dropped.
    Used after a graceful stop: those samples were not trained and stay in the untrained part of the plan."""
    dropped = 0
    got = pending.complete() if pending is not None else None
    for t in topo.my_feeders:
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
    # this step's plan (a colocated rank's with its target half), next to its measured peak
    plan = plan_rank(job.cfg, text_config(job.hf_config), job.hf_config, job.drafter,
                     "colocated" if topo.colocated else "drafter", device.type, len(job.layer_ids), [(b_, s_pad)],
                     topo.num_drafters, parallel="fsdp" if trainer.parallel.sharded else "ddp")
    rep = startup_report(lambda: trainer.train_step(batch), trainer.model,
                         {"b": b_, "S_pad": s_pad, "Q": q_len, "first_step_s": first_step_s, "guard": trainer.guard,
                          "precompile_s": trainer.precompile_s, "memory_plan": plan},
                         device, print_fn=log.info if topo.is_leader else log.debug)
    if topo.is_leader:
        path = os.path.join(job.run_dir, "startup_report.json")
        with writing(path, "the startup report"), open(path, "w") as f:
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


def run_drafter(job: DrafterJob) -> None:
    DrafterRun(job).run()


class DrafterRun:
    """One drafter rank's run, in the order its steps happen: connect, precompile, then per step receive ->
    train -> account -> (stop agreement) -> (metrics window) -> (evaluation) -> (checkpoint); finish: END of
    every target (or a drain after a graceful stop), the final checkpoint, accounting and the run's summary."""

    def __init__(self, job: DrafterJob):
        self.job, self.cfg, self.d, self.topo, self.life = job, job.cfg, job.dist, job.dist.topo, job.life
        self.trainer = DrafterTrainer(job)
        self.describe()
        self.run_messages = job.total_messages - job.start_cursor
        self.steps = self.topo.num_steps(self.run_messages)
        self.total_steps = self.trainer.total_steps()
        self.writer = MetricsWriter(job.run_dir, self.cfg.to_dict(), self.cfg.logging.wandb, self.total_steps,
                                    self.topo.is_leader, self.cfg.logging.progress_bar)
        if job.plan_record is not None:  # topology.target_ranks=auto: the measured rates and the split, once
            self.writer.log(job.start_step, job.plan_record, kind="plan")
        self.connect()
        mine = list(self.topo.drafter_messages(self.run_messages))
        self.pending = self.rx.post(self.topo.target_for(mine[0]), job.start_cursor + mine[0]) if mine else None
        self.rate = RateMeter()
        self.bytes_seen = 0
        self.peak = self.cfg.logging.peak_tflops or nominal_peak_tflops(self.d.device)  # None on CPU: no MFU
        self.target_peak = target_peak_tflops(self.cfg, job.hf_config, self.d.device)  # FP8 targets: the FP8 peak
        self.target_stats, self.prev_target_stats = {}, {}
        self.ends_seen: set = set()
        self.wait_s = self.busy_s = 0.0
        self.seen_time = (0.0, 0.0, 0.0, 0.0)  # (wait, busy, wall, stream wait) at the last window: per window
        self.stream_wait = StreamWaitMeter(self.d.device)
        self.stopped = False
        self.stop_at = None
        self.sample_log = self.open_sample_log()
        self.fault = fault_for(self.d.rank)  # failure tests only
        self.leader_eval = LeaderEval(job, self.trainer.model) if eval_enabled(job) and self.topo.is_leader else None
        # every drafter knows the steps: under FSDP each takes part in gathering the weights evaluated
        self.eval_at = set(eval_steps(job)) if eval_enabled(job) else set()
        self.last_window = None
        self.last_tau = None  # (step, pooled acceptance length, z-lab's tau) of the newest in-training evaluation
        self.plan_check = plan_check_for(job) if self.topo.is_leader else None  # planned vs measured samples/s
        self.first_step_s = None
        self.memory = PeakMemory(self.d.device)
        # (time, step, this rank's samples taken for training) at the end of the early checked steps, and newest
        self.pace = None
        self.t_start = time.monotonic()

    def describe(self) -> None:
        cfg, trainer = self.cfg, self.trainer
        n_params = sum(p.numel() for p in trainer.model.parameters())
        if trainer.leaky_mask:
            log.warning("%s=1: training with the LEAKY mask (kv <= anchor) on purpose (a demonstration, never use "
                        "it)", LEAKY_MASK_ENV)
        kernel = trainer.model.flex_kernel_options  # drafter.tuning.flex_kernel_options, or the device's defaults
        flex_desc = (f" (compiled flex_attention, {'dynamic' if trainer.flex_dynamic else 'static'} shapes"
                     f"{', compiled layers' if trainer.compile_layers else ''}"
                     f"{', compiled loss' if trainer.compile_loss else ''}"
                     f"{', kernel options ' + str(kernel) if kernel else ''})")
        log.info("drafter: %s, %d layers, %.2fM trainable params, attention backend=%s%s, anchors=%d, block=%d, "
                 "loss %s", trainer.spec.variant, cfg.drafter.num_layers, n_params / 1e6, trainer.backend,
                 flex_desc if trainer.backend == "flex" else " (dense bool mask, SDPA)",
                 cfg.drafter.num_anchors, trainer.block_size, trainer.objective.describe())
        if self.topo.is_leader:
            log.info("drafter training state: %s", trainer.parallel.describe())

    def connect(self) -> None:
        """The data channel from every feeding target and, with drafter.tuning.loss_on_target, the head groups."""
        cfg, d, trainer, tuning = self.cfg, self.d, self.trainer, self.cfg.drafter.tuning
        self.head_channel = self.reply_channel = None
        if self.job.local is not None:  # colocated: this rank's target half produces each message when it is taken
            self.channel, self.rx = self.job.local, self.job.local.receiver
            if tuning.loss_on_target:
                log.info("drafter.tuning.loss_on_target: the target is on this rank, so the lm_head and loss run "
                         "here")
            return
        self.channel = job_channel(d, cfg.topology, check=self.life.check, serve_heads=tuning.loss_on_target)
        self.channel.connect(self.topo.feeders, sending=False)  # before any payload: see Channel.connect
        self.rx = Receiver(self.channel, self.d.rank)
        if tuning.loss_on_target:
            servers = head_servers(self.topo, trainer.objective)  # a replica's ranks, each its vocabulary slice
            self.head_channel, self.reply_channel = head_channels(d, cfg.topology.warmup_timeout_s, self.life.check,
                                                                  sorted({q for v in servers.values() for q in v}),
                                                                  drafter=True)
            trainer.heads = HeadLossClient(self.head_channel, self.reply_channel, d.rank, trainer.lm_head,
                                           trainer.objective, servers=servers)
        if trainer.micro_batches > 1 or self.head_channel is not None:
            served = trainer.micro_batches - tuning.local_loss_groups
            log.info("drafter step: %d group(s) of %d anchors, each its own forward; lm_head and loss %s",
                     trainer.micro_batches, cfg.drafter.num_anchors // trainer.micro_batches,
                     f"of {served} group(s) on the target that sent the message (drafter.tuning.loss_on_target), "
                     f"of {tuning.local_loss_groups} on this rank" if self.head_channel is not None else "on this rank")

    def open_sample_log(self):
        """logging.debug.record_sample_ids: <run_dir>/sample_log/rank<r>.jsonl, one line per message trained."""
        if not self.cfg.logging.debug.record_sample_ids:
            return None
        os.makedirs(os.path.join(self.job.run_dir, "sample_log"), exist_ok=True)
        return open(os.path.join(self.job.run_dir, "sample_log", f"rank{self.d.rank}.jsonl"), "a", buffering=1)

    def run(self) -> None:
        self.precompile()
        log_every, checkpoint_every = self.cfg.logging.log_every, self.cfg.train.checkpoint_every
        for s in range(self.steps):
            t0 = time.monotonic()
            j = s * self.topo.num_drafters + self.topo.index
            msg = self.receive(j)
            t1 = time.monotonic()
            stall_if_due(self.fault, s)
            self.train(s, msg, self.job.start_cursor + j)
            if s == 0:
                self.first_step_s = time.monotonic() - t1
            self.account_step(s, msg, t0, t1)
            last = s == self.steps - 1
            stop_now = self.stop_due(last)
            if self.trainer.step % log_every == 0 or last or stop_now or s == 0:  # s 0: the curve's start
                self.log_window()
            self.evaluation_tick()
            if stop_now:
                self.stopped = True
                break
            if checkpoint_every and self.trainer.step % checkpoint_every == 0 and not last:
                self.trainer.save()
        self.finish()

    def precompile(self) -> None:
        trainer = self.trainer
        if trainer.precompile_plan:
            took = trainer.precompile()  # the compiles of the planned shapes now, not when training reaches them
            log.info("precompiled %d planned batch shapes in %.1f s before training (dry steps, nothing updated): "
                     "%s", len(trainer.precompile_plan), took,
                     ", ".join(f"{len(x)} sample(s) up to {max(x)} tokens" for x in trainer.precompile_plan))

    def receive(self, j: int):
        """Run message ``j``'s features (None past the end: this rank joins the step with an empty batch); the
        receive of this rank's next message is posted at once, so it lands while this one trains."""
        if j >= self.run_messages:
            return None
        before = self.stream_wait.mark()
        msg = self.pending.complete()
        self.stream_wait.add(before, self.stream_wait.mark())
        self.pending = None
        if isinstance(msg, EndOfStream):
            raise RuntimeError(f"target rank {msg.src} ended its stream before message {self.job.start_cursor + j}")
        self.target_stats[msg.src] = msg.sender_stats
        self.trainer.note_received(msg)
        nxt = j + self.topo.num_drafters
        if nxt < self.run_messages:
            self.pending = self.rx.post(self.topo.target_for(nxt), self.job.start_cursor + nxt)
        return msg

    def train(self, s: int, msg, k: int) -> None:
        """Build step ``s``'s blocks and masks and train it; a few early steps run under a check."""
        trainer, d = self.trainer, self.d
        if s == 1:  # one profiled step after the warm-up step: what really ran, memory, compile/cache
            profiled_step(trainer, trainer.build(msg, k), self.first_step_s, self.job)
        elif s == SYNC_CHECK_STEP:  # after warm-up: does a step make the host wait for the GPU?
            log_host_syncs(lambda: trainer.train_step(trainer.build(msg, k)), trainer.step, d.device)
        elif s == self.cfg.logging.debug.profile_step:  # a step's phases on the GPU timeline, asked for
            trace_step(trainer, trainer.build(msg, k), s, self.job)
        else:
            trainer.train_step(trainer.build(msg, k))

    def account_step(self, s: int, msg, t0: float, t1: float) -> None:
        """The rate, the sample log, the trainer's step (it moves its step, cursor and counts), wait/busy time;
        after step 1 the steady timeouts."""
        trainer, topo = self.trainer, self.topo
        if msg is not None:
            self.rate.add(msg.num_samples, msg.num_tokens)
            if self.sample_log is not None:
                # who sent it from which node, and a fingerprint of the weights after the step (equal on every
                # drafter at every step while their data-parallel steps stay in lockstep)
                self.sample_log.write(json.dumps({
                    "k": msg.index, "step": trainer.step, "ids": msg.sample_ids.tolist(), "from": msg.src,
                    "from_node": topo.node_of(msg.src), "to": self.d.rank, "to_node": topo.node_of(self.d.rank),
                    "weights_fp": trainer.parallel.fingerprint()}) + "\n")
        trainer.finish_step(s, msg)
        self.wait_s += t1 - t0
        self.busy_s += time.monotonic() - t1
        if s >= SYNC_CHECK_STEP:  # the pace after the compiles and the checked steps, for the run's last lines
            c = trainer.counts
            mark = (time.monotonic(), trainer.step, c["samples_received"] - c["samples_skipped_shape"])
            self.pace = (mark if self.pace is None else self.pace[0], mark)
        if s == 1:
            timeout = self.cfg.topology.timeout_s
            self.channel.timeout_s = timeout
            if self.head_channel is not None:
                self.head_channel.timeout_s = self.reply_channel.timeout_s = timeout
            shorten_timeouts(self.d, timeout)

    def stop_due(self, last: bool) -> bool:
        """Graceful stop: the leader fixes a step two ahead; drafters are in lockstep (DDP), so all see it in
        time. True once this rank reached that step (never on the last step: that one finishes normally)."""
        requested = self.life.stop_requested()  # posts this rank's own signal, if it got one
        if self.topo.is_leader and self.stop_at is None and requested:
            self.stop_at = self.trainer.step + 2
            self.life.announce_stop(self.stop_at)
        if self.stop_at is None:
            self.stop_at = self.life.stop_step()
        return self.stop_at is not None and self.trainer.step >= self.stop_at and not last

    def log_window(self) -> None:
        """The metrics of the steps since the last window (all drafters: one all-reduce of the trainer's sums,
        one of the rates), evaluations that finished meanwhile, the progress bar or a line."""
        window = self.window_metrics()
        self.last_window = window
        if self.leader_eval is not None:
            for at, res in self.leader_eval.ready():
                self.log_evaluation(at, res)
        if self.topo.is_leader:
            trainer = self.trainer
            self.writer.log(trainer.step, window)
            if self.plan_check is not None:
                self.plan_check.add(trainer.step, window["samples_per_s"])
            self.writer.progress(trainer.step, {"loss": f"{window['loss']:.3f}", "acc": f"{window['acc']:.3f}",
                                                "samples/s": f"{window['samples_per_s']:.1f}"})
            if self.writer.bar is None:  # no bar (logging.progress_bar=false, or not a terminal): a line
                log.info("step %d/%d loss %.4f acc %.3f lr %.2e %.1f samples/s", trainer.step, self.total_steps,
                         window["loss"], window["acc"], window["lr"], window["samples_per_s"])

    def window_metrics(self) -> dict:
        d, topo = self.d, self.topo
        window = self.trainer.read_window()
        if self.trainer.guard is not None:
            dc = dynamo_counters()
            window.update({f"compile/{k}": dc[k] for k in ("unique_graphs", "graph_breaks", "recompiles")})
        r = self.rate.take()
        link_bps = (self.rx.bytes_received - self.bytes_seen) / r["window_s"]
        self.bytes_seen = self.rx.bytes_received
        rates = torch.tensor([r["samples_per_s"], r["tokens_per_s"], link_bps], dtype=torch.float64, device=d.device)
        dist.all_reduce(rates, group=d.drafters)  # job throughput = sum over drafters
        sps, tps, link = rates.tolist()
        wall = time.monotonic() - self.t_start
        dwall = max(wall - self.seen_time[2], 1e-9)
        stream_wait_s = self.stream_wait.seconds()
        window.update({"samples_per_s": sps, "tokens_per_s": tps, "link_gb_per_s": link / 1e9,
                       "drafter_samples_per_s": sps / topo.num_drafters,
                       "drafter_wait_frac": (self.wait_s - self.seen_time[0]) / dwall,
                       "drafter_busy_frac": (self.busy_s - self.seen_time[1]) / dwall,
                       "drafter_stream_wait_frac": (stream_wait_s - self.seen_time[3]) / dwall,
                       "epoch_progress": self.trainer.cursor / max(self.job.total_messages, 1)})
        peak_gib = self.memory.window()
        if peak_gib is not None:
            window["peak_memory_gib"] = peak_gib
        if self.peak:  # model FLOPs of all drafters over the window / (drafters x window x peak)
            window["drafter_mfu"] = window["model_flops"] / (topo.num_drafters * r["window_s"] * self.peak * 1e12)
        window.update(target_window_metrics(self.target_stats, self.prev_target_stats, self.target_peak))
        self.prev_target_stats = dict(self.target_stats)
        self.seen_time = (self.wait_s, self.busy_s, wall, stream_wait_s)
        return window

    def log_evaluation(self, at: int, res) -> dict:
        rec = eval_record(res, self.last_window)
        self.writer.log(at, rec, kind="eval")
        self.last_tau = (at, rec.get("acceptance_length"), rec.get("tau"))
        return rec

    def evaluation_tick(self) -> None:
        if self.leader_eval is not None:
            self.leader_eval.pump()  # the weights of a requested evaluation, once the target posted its receive
        if self.trainer.step in self.eval_at:
            weights = self.trainer.parallel.gathered_weights()  # FSDP: every drafter gathers; else None
            if self.leader_eval is not None and self.stop_at is None:  # after a stop it would only be abandoned
                self.leader_eval.request(self.trainer.step, weights)

    def finish(self) -> None:
        if self.stopped:
            self.stop_and_drain()
            self.report(account(self.trainer, self.d, self.target_stats, self.stopped))
            return
        self.take_ends()
        self.trainer.save(final=True)
        # the drafters' last collective before the leader's wait for the final evaluation (up to the warm-up
        # limit): the others would otherwise wait in it under the short topology.timeout_s and fail the job
        accounting = account(self.trainer, self.d, self.target_stats, self.stopped)
        self.last_evaluations()
        self.report(accounting)

    def stop_and_drain(self) -> None:
        """After a graceful stop: a checkpoint at the cursor, then whatever the targets still send is dropped
        (those samples were not trained: the checkpoint's cursor excludes them)."""
        if self.leader_eval is not None:
            self.leader_eval.close()
        self.trainer.save(final=False, reason="signal")
        if self.topo.is_leader:
            log.warning("stopped on request after step %d; resume with train.resume=auto", self.trainer.step)
        dropped = drain(self.rx, self.topo, self.pending, self.ends_seen, self.target_stats)
        self.trainer.counts["samples_dropped_after_stop"] = dropped

    def take_ends(self) -> None:
        for t in self.topo.my_feeders:  # every target says END once its share is sent
            end = self.rx.post(t).complete()
            if not isinstance(end, EndOfStream):
                raise RuntimeError(f"expected END from target rank {t}, got message {end.index}")
            self.ends_seen.add(t)
            self.target_stats[t] = end.sender_stats

    def last_evaluations(self) -> None:
        if self.leader_eval is None:
            return
        for at, res in self.leader_eval.ready(block_s=self.cfg.topology.warmup_timeout_s):
            rec = self.log_evaluation(at, res)
            log.info("acceptance at step %d: acceptance length %.3f (pooled over verify steps; training accuracy "
                     "predicts %.3f), z-lab's tau %.3f (mean over prompts%s) on %d held-out prompts", at,
                     rec.get("acceptance_length") or float("nan"), rec.get("tau_from_train_acc") or float("nan"),
                     rec.get("tau") or float("nan"),
                     f", {rec.get('prompts_one_step')} that ended in their first block left out"
                     if rec.get("one_step_excluded") and rec.get("prompts_one_step") else "", rec["n_prompts"])

    def report(self, accounting: dict) -> None:
        """(Leader) the job-wide accounting and the last lines of the run: what it did and where the results are."""
        trainer, job = self.trainer, self.job
        wall = time.monotonic() - self.t_start
        totals = run_totals(trainer.before, accounting, job.plan, trainer.cursor)  # over all the run's launches
        if self.topo.is_leader:
            self.writer.log(trainer.step, dict(accounting, **totals), kind="accounting")
            log.info("%s: %d steps, %d of %d messages trained in %.1f s; samples %s",
                     "stopped" if self.stopped else "done", trainer.step, trainer.cursor, job.total_messages, wall,
                     {k: int(v) for k, v in accounting.items()})
            if self.stopped:
                record_dropped(job.run_dir, trainer.last_checkpoint, int(accounting["samples_dropped_after_stop"]))
            plan = None if self.plan_check is None else self.plan_check.record()
            if plan is not None:
                self.writer.log(trainer.step, plan, kind="plan_check")
        self.writer.close()
        if self.topo.is_leader:
            log.info("%s", run_summary(
                stopped=self.stopped, steps=trainer.step, steps_this_run=trainer.step - job.start_step,
                samples=int(accounting["samples_trained"]), wall_s=time.monotonic() - self.t_start,
                loss=None if self.last_window is None else self.last_window.get("loss"), tau=self.last_tau,
                checkpoint=trainer.last_checkpoint, metrics_path=self.writer.path, wandb_dir=self.writer.wandb_run_dir,
                wandb_mode=self.writer.wandb_mode, totals=totals, launch=accounting,
                plan=None if self.plan_check is None else plan_line(plan), memory=self.memory_line(),
                pace=self.pace_line()))

    def pace_line(self):
        """How the wall time splits: the first steps (compiles, the checked steps), the steady ones after them and
        their rate over this rank's own samples, and the rest (startup, precompile, the final checkpoint)."""
        if self.pace is None or self.pace[1][1] - self.pace[0][1] < 2:
            return None
        (t0, k0, n0), (t1, k1, n1) = self.pace
        d = self.topo.num_drafters
        return (f"pace:       steps {self.job.start_step + 1}-{k0} (compiles, checked steps) to "
                f"{t0 - self.t_start:.1f} s; steps {k0 + 1}-{k1} in {t1 - t0:.1f} s, "
                f"{(n1 - n0) / max(t1 - t0, 1e-9):.1f} samples/s on this drafter rank" + (f" (of {d})" if d > 1 else "")
                + f"; after the last step {time.monotonic() - t1:.1f} s (the final checkpoint, a last evaluation)")

    def memory_line(self):
        """The run's peak device memory next to the plan of the largest step its batching plan makes."""
        if self.memory.run_peak is None:
            return None
        job, topo = self.job, self.topo
        steps = plan_steps(job.sample_lengths, job.plan, job.cfg.drafter.tuning.ctx_bucket)
        plan = plan_rank(job.cfg, text_config(job.hf_config), job.hf_config, job.drafter,
                         "colocated" if topo.colocated else "drafter", self.d.device.type, len(job.layer_ids), steps,
                         topo.num_drafters, parallel="fsdp" if self.trainer.parallel.sharded else "ddp")
        where = f"at its largest step (b={plan.shape[0]}, S_pad={plan.shape[1]})" if plan.shape else ""
        return self.memory.line(plan.total - plan.parts.get("process", 0), where)


def account(trainer, d, target_stats: dict, stopped: bool) -> dict:
    """Job-wide sample accounting (all drafters): received = trained + skipped (+ dropped after a stop)."""
    c = trainer.counts
    # what the targets sent, from their last stats: every drafter knows every target's (END comes to all), except
    # on colocated ranks, where each knows only its own target half: there every rank counts its own
    known = target_stats if d.topo.colocated or d.topo.is_leader else {}
    c = dict(c, samples_sent=sum(st[3] for st in known.values() if st))
    keys = ["samples_received", "samples_skipped_shape", "samples_dropped_after_stop", "messages_received",
            "samples_sent"]
    v = torch.tensor([float(c.get(k, 0)) for k in keys], dtype=torch.float64, device=d.device)
    dist.all_reduce(v, group=d.drafters)
    out = dict(zip(keys, v.tolist()))
    out["samples_skipped_nonfinite"] = float(sum(trainer.nonfinite_by_target))
    out["samples_trained"] = (out["samples_received"] - out["samples_skipped_shape"]
                              - out["samples_skipped_nonfinite"])
    return out  # samples_sent = what drafters took for training + what they dropped after a graceful stop
