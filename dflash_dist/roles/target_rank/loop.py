"""Target rank: run the frozen model over this rank's share of the plan and stream features to drafters.

``run_target`` loads the model; a replica's follower (``run_replica_follower``) then runs the same forwards and
sends nothing, while its feeder streams through a ``TargetRun``: set up once (fast-path check, head weights,
capture, dataset, channel and Sender, head server, evaluator, traces), then per message ``should_stop`` (the
replica agrees on a graceful stop), ``serve_heads_before`` (the loss on the target), ``batch``, ``capture`` (stall
and forward timed apart), ``send``, ``write_trace_line`` and ``maybe_go_steady`` (the steady-state timeout once
the drafters are warm), and ``finish`` (last head replies, END, flush, last evaluations, summary line).
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from dflash_dist.comm.distributed import any_rank, shorten_timeouts
from dflash_dist.comm.faults import apply_target_fault, fault_for, stall_if_due
from dflash_dist.comm.head_offload import HeadLossServer, head_channels, head_servers
from dflash_dist.comm.transport import Message, Sender, job_channel
from dflash_dist.data.tokenize import TokenizedDataset
from dflash_dist.eval.follower import FollowerEval
from dflash_dist.eval.in_training import EVAL_REQUEST_PATIENCE_S, TargetEval, eval_enabled, expected_evals
from dflash_dist.eval.replica import whole_head
from dflash_dist.targets.fast_path import check_target_fast_path
from dflash_dist.model.head_shards import vocab_slice
from dflash_dist.targets.hf import (
    build_target_model,
    build_target_replica,
    head_weights,
    load_head_from_checkpoint,
    local_parameter_bytes,
    random_target_dir,
    resolve_source,
)
from dflash_dist.role_jobs import TargetJob
from dflash_dist.roles.target_rank.batch import pad_batch
from dflash_dist.roles.target_rank.capture import build_capture
from dflash_dist.roles.target_rank.trace import MessageTimes, capture_flops_fn, open_trace, write_message_line
from dflash_dist.telemetry.step_trace import TraceWindow, format_timeline, phase

log = logging.getLogger("dflash_dist")


def send_head_weights(job, model) -> None:
    """Random-init targets: the first target (replica 0's feeder) hands its embedding and lm_head to every
    drafter, once. A sharded replica reads them whole by key from the checkpoint it was loaded from. A colocated
    rank hands its own to its drafter half, whatever the target (no second copy on the device)."""
    if job.local is not None:
        job.local.heads = head_weights(model)
        return
    path, _ = resolve_source(job.cfg.target)
    topo = job.dist.topo
    if path is not None or topo.index != 0 or topo.replica_rank != 0:
        return
    if topo.tp > 1:
        tied = bool(getattr(job.hf_config, "tie_word_embeddings", False))
        embed, head = load_head_from_checkpoint(random_target_dir(job.run_dir, topo.node_of(topo.rank)), tied)
    else:
        embed, head = head_weights(model)
    for d in topo.drafter_ranks:
        dist.send(embed.detach().contiguous(), d, group=job.dist.data)
        dist.send(head.detach().contiguous(), d, group=job.dist.data)


def head_server(job, model, tx=None):
    """drafter.tuning.loss_on_target: connect the head groups and build this rank's HeadLossServer (None when off,
    or on a follower of a replica whose feeder serves alone). A feeder's requests are served first whenever its
    Sender (``tx``) waits on a drafter; a follower serves between its captures."""
    cfg, d = job.cfg, job.dist
    if not cfg.drafter.tuning.loss_on_target:
        return None
    objective = job.drafter.make_objective()
    serving = head_servers(d.topo, objective)[d.topo.my_replica[0]]
    if d.rank not in serving:
        return None
    # after the data group's connection, as on the drafters
    ch, replies = head_channels(d, cfg.topology.warmup_timeout_s, job.life.check, d.topo.drafter_ranks, drafter=False)
    dc = cfg.drafter
    compiled = job.drafter.loss.compiled  # the drafter's objective, resolved once for the job (model/spec.py)
    lo = None
    if len(serving) > 1:  # this rank's slice of the vocabulary (the model's own lm_head shard has its own layout)
        whole = whole_head(job, model)[1]
        vocab = whole.shape[0]
        lo, hi = vocab_slice(vocab, len(serving), serving.index(d.rank))
        head = whole[lo:hi].clone()
        del whole
        how = f"vocabulary rows [{lo}, {hi}) of {vocab}: each rank of replica {serving} serves its slice"
    elif d.topo.tp > 1:  # no slice math for this objective: the feeder serves with the whole lm_head
        head = whole_head(job, model)[1]
        how = f"the whole lm_head on the replica's feeder ({objective.name} has no vocabulary-slice math)"
    else:
        head = head_weights(model)[1]
        how = "the whole lm_head"
    requests = dc.tuning.micro_batches - dc.tuning.local_loss_groups
    server = HeadLossServer(ch, replies, d.rank, head, objective, requests,
                            before_serve=tx.pump if tx is not None else None, slice_lo=lo)
    if tx is not None:
        tx.serve = server.poll
    log.info("lm_head and loss of the drafters' steps run here (drafter.tuning.loss_on_target): %d request(s) per "
             "message, %s loss, %s", requests, "compiled" if compiled else "eager", how)
    return server


# A drafter takes its third message only after its first two steps (first compile, the profiled step), and switches
# to the steady-state timeout after them: until each of this target's drafters has taken that many, a slow drafter
# is warming up, not dead (counting sends posted instead let a first compile over timeout_s kill the job).
WARM_MESSAGES = 3


class MessageTrace:
    """logging.debug.profile_step on a target rank: its first message for drafter step N (capture, send, the drafter
    taking it) under torch.profiler; the Chrome trace goes to <run_dir>/profile/target_rank<r>_step<N>.json and its
    phase timeline to the log. Nothing this rank posted is in flight when the window starts or stops: a profiler
    start or stop while a gloo isend is in flight crashed the sender (bench/experiments/profiler_gloo_window.py), and
    the headers travel over gloo on every job. So the window waits for the drafters to take every earlier message and
    head reply before it starts, ends once the traced message is taken, and runs no evaluation slice."""

    def __init__(self, job, tx: Sender, heads: Optional[HeadLossServer]):
        self.step, self.job, self.tx, self.heads = job.cfg.logging.debug.profile_step, job, tx, heads
        self.window: Optional[TraceWindow] = None
        self.done = self.step < 0
        self._idle_work = None

    def wants(self, j: int) -> bool:
        return not self.done and self.window is None and j // self.job.dist.topo.num_drafters == self.step

    def _quiesce(self) -> None:
        self.tx.flush()  # serves head requests meanwhile (a drafter may need them to take its messages)
        if self.heads is not None:
            self.heads.wait_replies()

    def start(self) -> None:
        self._quiesce()
        self._idle_work, self.tx.idle_work = self.tx.idle_work, None
        self.window = TraceWindow(self.job.dist.device)
        self.window.start()

    def finish(self) -> None:
        with phase("drafter takes it"):
            self._quiesce()
        r = self.job.dist.rank
        path = os.path.join(self.job.run_dir, "profile", f"target_rank{r}_step{self.step}.json")
        tl = self.window.stop(path)
        self.tx.idle_work, self.window, self.done = self._idle_work, None, True
        log.info("%s\ntrace: %s", format_timeline(tl, f"target rank {r}, its message for step {self.step} (traced "
                                                      "alone: earlier sends taken first)"), path)


def serve_last_evaluations(job, evaluator, stopped: bool) -> None:
    """After this rank's stream: finish the running evaluation and serve what the leader still asks for (its
    last request comes after the final step), unless the job stops early (now or meanwhile: a stop announced
    after this rank sent its last message); then drop it (TargetEval.close)."""
    if not stopped:
        evaluator.finish()
        patience = job.cfg.topology.warmup_timeout_s if evaluator.n == 0 else EVAL_REQUEST_PATIENCE_S
        deadline = time.monotonic() + patience
        while evaluator.n < expected_evals(job) and job.life.stop_step() is None and time.monotonic() < deadline:
            if evaluator.poll(wait_s=1.0, whole=True):
                deadline = time.monotonic() + EVAL_REQUEST_PATIENCE_S
    if evaluator.n < expected_evals(job):
        evaluator.close()
    evaluator.done()


def load_target(job):
    """This rank's target: the whole model, or (target.tensor_parallel > 1) its shard of the replica's."""
    cfg, d = job.cfg, job.dist
    topo = d.topo
    t0 = time.time()
    if topo.tp == 1:
        model = build_target_model(cfg.target, d.device.type)
    else:
        node = topo.node_of(topo.rank)
        key = f"dflash/random_target/node{node}"
        first_on_node = min(r for r in topo.target_ranks if topo.node_of(r) == node)

        def announce():
            d.store.set(key, "ready")

        def wait():
            d.store.wait([key], timedelta(seconds=cfg.topology.warmup_timeout_s))
        model = build_target_replica(cfg.target, d.device.type, d.tp, random_target_dir(job.run_dir, node),
                                     build_random=topo.rank == first_on_node, ready=(announce, wait))
    local, full = local_parameter_bytes(model)
    log.info("target loaded in %.1f s (%s, %s)%s", time.time() - t0, type(model).__name__,
             next(model.parameters()).dtype,
             f"; replica {topo.index} ranks {topo.my_replica}, tensor-parallel: this rank holds {local} of {full} "
             f"parameter bytes ({100 * local / full:.0f}%)" if topo.tp > 1 else "")
    return model


def replica_stops(d, stop: bool) -> bool:
    """The ranks of a replica agree whether to run the next message (any of them saw the stop: all stop), so none
    enters a forward its peers never join. A single-rank replica decides alone."""
    if d.tp_ctrl is None:
        return stop
    return any_rank(stop, d.tp_ctrl)  # the replica's gloo group: a host tensor


def first_untrained(job) -> Optional[int]:
    """The first run message the drafters will not train, once a graceful stop is announced (None before)."""
    at = job.life.stop_step()
    return None if at is None else (at - job.start_step) * job.dist.topo.num_drafters


def stream_stops(job, j: int) -> bool:
    """Whether this replica stops before run message j: the drafters stop after the announced step, so nothing
    from j on would be trained. Posts this rank's own signal first, if it got one."""
    job.life.stop_requested()
    limit = first_untrained(job)
    return replica_stops(job.dist, limit is not None and j >= limit)


def run_replica_follower(job, model) -> None:
    """A rank of a replica other than its feeder: the same messages, the same forwards (the model's collectives
    need every rank of the replica), nothing sent."""
    cfg, d = job.cfg, job.dist
    topo = d.topo
    capture = build_capture(cfg.target, model, job.layer_ids, d.device.type)
    dataset = TokenizedDataset.load(job.dataset_path)
    fault = fault_for(d.rank)
    evals = FollowerEval(job, model) if eval_enabled(job) and topo.index == 0 else None  # its feeder's evaluations
    heads = head_server(job, model)  # its slice of the vocabulary, with the loss on the target
    run_messages = job.total_messages - job.start_cursor
    done, t0 = 0, time.monotonic()
    for j in topo.target_messages(run_messages):
        if stream_stops(job, j):
            break
        if evals is not None:  # where the feeder polls its evaluator
            evals.at_boundary()
        if heads is not None:  # the feeder's rule: two rounds back served before message j's capture
            heads.serve_through(j - 2 * topo.num_drafters, stop_limit=lambda: first_untrained(job))
        k = job.start_cursor + j
        batch = [dataset[i] for i in job.plan[k]]
        stall_if_due(fault, done)
        ids, lengths, _, _ = pad_batch(batch, d.device, capture.packing)
        apply_target_fault(fault, done, capture.for_loss(ids, lengths, job.drafter.loss)[0])
        if heads is not None:
            heads.expect(j, k, topo.drafter_for(j))
        done += 1
    if heads is not None:
        heads.finish(stop_limit=lambda: first_untrained(job))
    if evals is not None:
        evals.after_stream()
    capture.close()
    log.info("replica %d rank %d: %d messages run in %.1f s (features sent by rank %d)%s", topo.index, d.rank, done,
             time.monotonic() - t0, topo.my_replica[0], f"; {heads.describe()}" if heads is not None else "")


class TargetRun:
    """A feeder rank's stream, one method per step (run_target drives them in order). The counters (busy_s,
    stall_s, tokens, samples, sent, flops) are cumulative over the run and travel in every header (stats)."""

    def __init__(self, job: TargetJob, model):
        self.job, self.cfg, self.d, self.topo = job, job.cfg, job.dist, job.dist.topo
        check_target_fast_path(model, self.cfg.target.fast_path, self.d.device.type)  # logs the binding; require raises
        send_head_weights(job, model)
        self.feature_capture = build_capture(self.cfg.target, model, job.layer_ids, self.d.device.type)
        log.info("target capture: %s", self.feature_capture.describe())
        self.flops_per_batch = capture_flops_fn(model, job, self.feature_capture.packing,
                                                self.feature_capture.pad_multiple,
                                                own_labels=job.drafter.loss.labels == "target")
        self.dataset = TokenizedDataset.load(job.dataset_path)
        self._connect(model)
        self.run_messages = job.total_messages - job.start_cursor
        self.busy_s, self.stall_s, self.tokens, self.samples, self.sent, self.flops = 0.0, 0.0, 0, 0, 0, 0.0
        self.start = time.monotonic()
        self.stopped = self.steady = False
        self.fault = fault_for(self.d.rank)
        self.evaluator = self._evaluator(model) if eval_enabled(job) and self.topo.index == 0 else None
        self.trace = open_trace(job) if self.cfg.logging.debug.trace_target else None
        self.tracer = MessageTrace(job, self.tx, self.heads)

    def _connect(self, model) -> None:
        """The data channel to every drafter, the Sender over it, then the head groups (after the data group, as on
        the drafters)."""
        cfg, d = self.cfg, self.d
        if self.job.local is not None:  # colocated: this rank's drafter half takes the messages, and the loss
            self.channel, self.tx, self.heads = self.job.local, self.job.local.sender, None
            log.info("target sends: %s", self.channel.describe())
            return
        self.channel = job_channel(d, cfg.topology, check=self.job.life.check,
                                   serve_heads=cfg.drafter.tuning.loss_on_target)
        self.channel.connect(self.topo.drafter_ranks, sending=True)  # before any payload: see Channel.connect
        self.tx = Sender(self.channel, d.rank, cfg.topology.max_in_flight)
        self.heads = head_server(self.job, model, self.tx)
        log.info("target sends: %s, %s", "rendezvous (each payload posted once the drafter posted its receive)"
                 if self.channel.store is not None else "posted at once", self.channel.describe())

    def _evaluator(self, model) -> TargetEval:
        """The in-training evaluation this target (replica 0's feeder) runs: in slices while the Sender waits, when
        its waits can be polled, else whole between two messages."""
        tuning = self.cfg.train.tuning
        slices = tuning.eval_in_slices and self.channel.can_idle() and self.topo.tp == 1
        evaluator = TargetEval(self.job, model, slices=slices)
        if slices:
            self.tx.idle_work = evaluator.work
            how = "one verify step at a time while waiting for the drafters"
        elif self.job.local is not None:
            how = "whole, between two messages (colocated: the drafter half waits for it)"
        elif self.topo.tp > 1:
            how = (f"between two messages, verify steps for as long as the stream's work since the last, with every "
                   f"rank of replica {self.topo.my_replica}")
        elif tuning.eval_in_slices:
            how = ("whole, between two messages (train.tuning.eval_in_slices needs waits this target can poll: NCCL or "
                   "rendezvous sends; gloo sends block)")
        else:
            how = "whole, between two messages (train.tuning.eval_in_slices=false)"
        asked = self.cfg.train.eval_batch_size
        if evaluator.batch > 1:
            how += f", {evaluator.batch} prompts decoded together"
        elif asked > 1:
            how += f"; one prompt at a time (train.eval_batch_size={asked} applies only to an evaluation run whole, not on a replica)"
        log.info("in-training evaluation: %s", how)
        return evaluator

    def stats(self) -> tuple:
        """The cumulative statistics each header carries (transport.H_STATS), wall time up to now; served head
        requests count as busy time and FLOPs."""
        heads, tx = self.heads, self.tx
        served_s, served_flops = (heads.busy_s, heads.flops) if heads is not None else (0.0, 0.0)
        return (int((self.busy_s + served_s) * 1e6), int((tx.wait_s + self.stall_s) * 1e6), self.tokens, self.samples,
                int((time.monotonic() - self.start) * 1e6), int((self.flops + served_flops) / 1e6),
                int(tx.idle_work_s * 1e6))

    def stop_limit(self) -> Optional[int]:
        return first_untrained(self.job)

    def should_stop(self, j: int) -> bool:
        """A graceful stop reached run message j (recorded for finish)."""
        self.stopped = stream_stops(self.job, j)
        return self.stopped

    def serve_heads_before(self, j: int) -> None:
        """With the loss on the target: this rank's messages of two rounds back are trained before message j is
        captured."""
        heads, tx = self.heads, self.tx
        if heads is None:
            return
        t_serve = time.monotonic()
        eval0, served0 = tx.idle_work_s, heads.busy_s
        heads.serve_through(j - 2 * self.topo.num_drafters, idle=tx.idle_between, stop_limit=self.stop_limit)
        # waiting = this time less the evaluation and the GPU time of the requests served meanwhile (read as
        # their events complete: a little can land in a later wait)
        tx.wait_s += max(0.0, time.monotonic() - t_serve - (tx.idle_work_s - eval0) - (heads.busy_s - served0))

    def batch(self, j: int) -> list:
        return [self.dataset[i] for i in self.job.plan[self.job.start_cursor + j]]

    def capture(self, j: int, batch: list) -> tuple[Message, MessageTimes]:
        """Message j: its features from the forward over ``batch``, timed apart from the work already queued."""
        d, tx, cuda = self.d, self.tx, self.d.device.type == "cuda"
        if cuda:
            # Work already queued on the compute stream is not this message's forward: counted as waiting
            t_stall = time.monotonic()
            tx.wait_event(torch.cuda.current_stream().record_event())
            self.stall_s += time.monotonic() - t_stall
        t_busy = time.monotonic()
        stall_msg = t_busy - t_stall if cuda else 0.0
        stall_if_due(self.fault, self.sent)
        with phase("capture"):
            ids, lengths, packed_ids, packed_mask = pad_batch(batch, d.device, self.feature_capture.packing)
            feats, label_ids, label_probs = self.feature_capture.for_loss(ids, lengths, self.job.drafter.loss)
            feats = apply_target_fault(self.fault, self.sent, feats)
            if cuda:  # busy time = real forward time; ready payloads are posted meanwhile
                tx.wait_event(torch.cuda.current_stream().record_event())
        capture_msg = time.monotonic() - t_busy
        self.busy_s += capture_msg
        k = self.job.start_cursor + j
        msg = Message.build(k, self.job.plan[k], Message.cu_of(lengths), packed_ids, packed_mask, feats,
                            target_ids=label_ids, target_probs=label_probs)
        self.tokens += int(lengths.sum())
        self.samples += len(batch)
        self.flops += self.flops_per_batch(lengths.tolist())
        return msg, MessageTimes(stall_msg, capture_msg)

    def send(self, j: int, msg: Message, times: MessageTimes) -> None:
        """Posts message j to its drafter, headed by the stats up to now; the head server then awaits its requests."""
        tx = self.tx
        times.waited_s, times.evaluated_s, times.wall_s = tx.wait_s, tx.idle_work_s, time.monotonic() - self.start
        with phase("send"):
            tx.send(self.topo.drafter_for(j), msg, stats=self.stats())
        self.sent += 1
        if self.heads is not None:
            self.heads.expect(j, msg.index, self.topo.drafter_for(j))

    def write_trace_line(self, j: int, msg: Message, times: MessageTimes) -> None:
        """logging.debug.trace_target: message j's line (backpressure and evaluation: since just before its send)."""
        if self.trace is None:
            return
        write_message_line(self.trace, self.topo, self.d.rank, self.topo.drafter_for(j), msg, times, self.tx)

    def messages(self) -> range:
        """The run messages this replica streams, in order."""
        return self.topo.target_messages(self.run_messages)

    def step(self, j: int) -> bool:
        """Message j: serve what is due, capture, send. False (nothing done) when a graceful stop reached it."""
        if self.should_stop(j):
            return False
        self.serve_heads_before(j)
        if self.evaluator is not None:
            self.evaluator.poll()
        batch = self.batch(j)
        traced = self.tracer.wants(j)
        if traced:  # the traced message runs alone, earlier sends taken (MessageTrace)
            self.tracer.start()
        msg, times = self.capture(j, batch)
        self.send(j, msg, times)
        if traced:
            self.tracer.finish()
        self.write_trace_line(j, msg, times)
        self.maybe_go_steady()
        return True

    def maybe_go_steady(self) -> None:
        """Once this target's drafters are past warm-up (WARM_MESSAGES taken): the steady-state timeout from here."""
        if self.steady or not self.tx.all_took(WARM_MESSAGES):
            return
        self.steady = True
        timeout_s = self.cfg.topology.timeout_s
        self.channel.timeout_s = timeout_s
        if self.heads is not None:
            self.heads.ch.timeout_s = self.heads.replies.timeout_s = timeout_s
        shorten_timeouts(self.d, timeout_s)

    def finish(self) -> None:
        """End of stream: the last head replies, END to every drafter, every send taken; then the last evaluations
        and the summary line."""
        tx = self.tx
        if self.heads is not None:  # the replies of the last steps (none of a stopped job's untrained messages)
            self.heads.finish(idle=tx.idle_between, stop_limit=self.stop_limit)
        for dr in self.topo.my_drafters:
            tx.send_end(dr, stats=self.stats())
        tx.flush()
        wall = time.monotonic() - self.start
        if self.evaluator is not None:
            serve_last_evaluations(self.job, self.evaluator, self.stopped)
        self.feature_capture.close()
        if self.trace is not None:
            self.trace.close()
        self.log_summary(wall)

    def log_summary(self, wall: float) -> None:
        tx, heads, w = self.tx, self.heads, max(wall, 1e-9)
        log.info("target %s: %d messages, %d samples, %d tokens in %.1f s (%.0f tok/s, busy %.0f%%, "
                 "backpressure wait %.0f%%, stream stall before a capture %.0f%%, evaluation while waiting %.0f%%)%s",
                 "stopped" if self.stopped else "done", self.sent, self.samples, self.tokens, wall, self.tokens / w,
                 100 * self.busy_s / w, 100 * tx.wait_s / w, 100 * self.stall_s / w, 100 * tx.idle_work_s / w,
                 f"; {heads.describe()} = {100 * heads.busy_s / w:.0f}% of the time" if heads else "")


def run_target(job: TargetJob) -> None:
    """This target rank's part of the job: a replica's follower runs the forwards only; its feeder streams."""
    model = load_target(job)
    if not job.dist.topo.is_feeder:
        run_replica_follower(job, model)
        return
    run = TargetRun(job, model)
    for j in run.messages():
        if not run.step(j):
            break
    run.finish()
