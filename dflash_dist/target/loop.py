"""Target rank: run the frozen model over this rank's share of the plan and stream features to drafters."""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from dflash_dist.comm.distributed import shorten_timeouts
from dflash_dist.comm.faults import apply_target_fault, fault_for, stall_if_due
from dflash_dist.comm.head_offload import HeadLossServer, head_channels
from dflash_dist.comm.transport import Message, Sender, job_channel
from dflash_dist.config import resolve_backend
from dflash_dist.data.plan import pad_batch
from dflash_dist.data.tokenize import TokenizedDataset
from dflash_dist.eval.in_training import TargetEval, eval_enabled, expected_evals
from dflash_dist.model.hf import (
    build_target_model,
    build_target_replica,
    head_weights,
    load_head_from_checkpoint,
    local_parameter_bytes,
    random_target_dir,
    resolve_source,
)
from dflash_dist.target.capture import build_capture
from dflash_dist.telemetry.step_trace import TraceWindow, format_timeline, phase

log = logging.getLogger("dflash_dist")


def send_head_weights(job, model) -> None:
    """Random-init targets: the first target (replica 0's feeder) hands its embedding and lm_head to every
    drafter, once. A sharded replica reads them whole by key from the checkpoint it was loaded from."""
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


def capture_flops_fn(model, job, packed: bool = False, pad_multiple: int = 1):
    """lengths [b] -> forward FLOPs of one capture batch (decoder layers up to the last captured one, no lm_head)
    as it runs: padded, b x max(lengths) tokens rounded up to ``pad_multiple``; packed, each sample on its own
    (attention stays inside a sample).
    For the target's MFU in the metrics (``flops.target_forward_flops``)."""
    from dflash_dist.model.hf import decoder_layers, text_config
    from dflash_dist.telemetry.flops import target_capture_flops, target_layers_profile
    _, layers = decoder_layers(model)
    run = list(layers)[: max(job.layer_ids) + 1]
    tc = text_config(job.hf_config)
    # active experts only (MoE), linear-attention layers as they compute, sliding windows their window
    profile = target_layers_profile(run, tc)
    if packed:
        return lambda lengths: target_capture_flops(profile, tc, [(1, int(n)) for n in lengths])
    return lambda lengths: target_capture_flops(profile, tc,
                                                [(len(lengths), -(-int(max(lengths)) // pad_multiple) * pad_multiple)])


def head_server(job, model, tx):
    """drafter.tuning.loss_on_target: connect the head groups and build this rank's HeadLossServer (None when off). Its
    requests are served first whenever the Sender waits on a drafter."""
    cfg, d = job.cfg, job.dist
    if not cfg.drafter.tuning.loss_on_target:
        return None
    # after the data group's connection, as on the drafters
    ch, replies = head_channels(d, cfg.topology.warmup_timeout_s, job.life.check, d.topo.drafter_ranks, drafter=False)
    dc = cfg.drafter
    compiled = dc.tuning.compile_loss if dc.tuning.compile_loss is not None else resolve_backend(cfg, d.device.type) == "flex"
    server = HeadLossServer(ch, replies, d.rank, head_weights(model)[1], dc.block_size, dc.gamma, dc.tuning.loss_chunk_rows,
                            bool(compiled), dc.tuning.micro_batches - dc.tuning.local_loss_groups, before_serve=tx.pump)
    tx.serve = server.poll
    log.info("lm_head and loss of the drafters' steps run here (drafter.tuning.loss_on_target): %d request(s) per "
             "message, %s loss", dc.tuning.micro_batches - dc.tuning.local_loss_groups, "compiled" if compiled else "eager")
    return server


def open_trace(job):
    """logging.debug.trace_target: <run_dir>/target_trace/rank<r>.jsonl, one line per message, appended (a resumed job
    continues the file)."""
    path = os.path.join(job.run_dir, "target_trace")
    os.makedirs(path, exist_ok=True)
    log.info("target trace: %s", os.path.join(path, f"rank{job.dist.rank}.jsonl"))
    return open(os.path.join(path, f"rank{job.dist.rank}.jsonl"), "a", buffering=1)


# A drafter takes its third message only after its first two steps (first compile, the profiled step), and switches
# to the steady-state timeout after them: until each of this target's drafters has taken that many, a slow drafter
# is warming up, not dead (counting sends posted instead let a first compile over timeout_s kill the job).
WARM_MESSAGES = 3

# how long the target waits for the leader's next evaluation request after its stream (each request restarts it)
EVAL_REQUEST_PATIENCE_S = 120.0


class MessageTrace:
    """logging.debug.profile_step on a target rank: its first message for drafter step N (capture, send, the drafter
    taking it) under torch.profiler; the Chrome trace goes to <run_dir>/profile/target_rank<r>_step<N>.json and its
    phase timeline to the log. Nothing this rank posted is in flight when the window starts or stops: a profiler
    start or stop while a gloo isend is in flight crashed the sender (bench/profiler_gloo_window.py), and the
    headers travel over gloo on every job. So the window waits for the drafters to take every earlier message and
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
    flag = torch.tensor([int(stop)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=d.tp_ctrl)
    return bool(flag.item())


def run_replica_follower(job, model) -> None:
    """A rank of a replica other than its feeder: the same messages, the same forwards (the model's collectives
    need every rank of the replica), nothing sent."""
    cfg, d = job.cfg, job.dist
    topo = d.topo
    capture = build_capture(cfg.target, model, job.layer_ids, d.device.type)
    dataset = TokenizedDataset.load(job.dataset_path)
    fault = fault_for(d.rank)
    run_messages = job.total_messages - job.start_cursor
    done, t0 = 0, time.monotonic()
    for j in topo.target_messages(run_messages):
        job.life.stop_requested()
        stop_at = job.life.stop_step()
        if replica_stops(d, stop_at is not None and j >= (stop_at - job.start_step) * topo.num_drafters):
            break
        k = job.start_cursor + j
        batch = [dataset[i] for i in job.plan[k]]
        stall_if_due(fault, done)
        ids, lengths, _, _ = pad_batch(batch, d.device, capture.packing)
        apply_target_fault(fault, done, capture(ids, lengths))
        done += 1
    capture.close()
    log.info("replica %d rank %d: %d messages run in %.1f s (features sent by rank %d)", topo.index, d.rank, done,
             time.monotonic() - t0, topo.my_replica[0])


def run_target(job) -> None:
    cfg, d = job.cfg, job.dist
    topo = d.topo
    model = load_target(job)
    if not topo.is_feeder:
        run_replica_follower(job, model)
        return
    from dflash_dist.model.fast_path import check_target_fast_path
    check_target_fast_path(model, cfg.target.fast_path, d.device.type)  # logs the binding; require raises
    send_head_weights(job, model)
    capture = build_capture(cfg.target, model, job.layer_ids, d.device.type)
    packed = capture.packing
    log.info("target capture: %s", capture.describe())
    flops_per_batch = capture_flops_fn(model, job, packed, capture.pad_multiple)
    dataset = TokenizedDataset.load(job.dataset_path)
    channel = job_channel(d, cfg.topology, check=job.life.check, serve_heads=cfg.drafter.tuning.loss_on_target)
    channel.connect(topo.drafter_ranks, sending=True)  # before any payload: see Channel.connect
    tx = Sender(channel, d.rank, cfg.topology.max_in_flight)
    heads = head_server(job, model, tx)
    log.info("target sends: %s, %s", "rendezvous (each payload posted once the drafter posted its receive)"
             if channel.store is not None else "posted at once", channel.describe())

    run_messages = job.total_messages - job.start_cursor
    busy_s, stall_s, tokens, samples, sent, flops = 0.0, 0.0, 0, 0, 0, 0.0
    start = time.monotonic()
    stopped = steady = False
    fault = fault_for(d.rank)
    evaluator = None
    if eval_enabled(job) and topo.index == 0:
        slices = cfg.train.tuning.eval_in_slices and channel.can_idle()
        evaluator = TargetEval(job, model, slices=slices)
        if slices:
            tx.idle_work = evaluator.work
            how = "one verify step at a time while waiting for the drafters"
        elif cfg.train.tuning.eval_in_slices:
            how = ("whole, between two messages (train.tuning.eval_in_slices needs waits this target can poll: NCCL or "
                   "rendezvous sends; gloo sends block)")
        else:
            how = "whole, between two messages (train.tuning.eval_in_slices=false)"
        log.info("in-training evaluation: %s", how)
    trace = open_trace(job) if cfg.logging.debug.trace_target else None
    tracer = MessageTrace(job, tx, heads)

    def stats() -> tuple:
        """The cumulative statistics each header carries (transport.H_STATS), wall time up to now; served head
        requests count as busy time and FLOPs."""
        served_s, served_flops = (heads.busy_s, heads.flops) if heads is not None else (0.0, 0.0)
        return (int((busy_s + served_s) * 1e6), int((tx.wait_s + stall_s) * 1e6), tokens, samples,
                int((time.monotonic() - start) * 1e6), int((flops + served_flops) / 1e6), int(tx.idle_work_s * 1e6))

    def stop_limit():
        """The first run message the drafters will not train, once a graceful stop is announced."""
        at = job.life.stop_step()
        return None if at is None else (at - job.start_step) * topo.num_drafters
    for j in topo.target_messages(run_messages):
        job.life.stop_requested()  # posts this rank's own signal, if it got one
        stop_at = job.life.stop_step()
        if replica_stops(d, stop_at is not None and j >= (stop_at - job.start_step) * topo.num_drafters):
            stopped = True  # the drafters stop after step stop_at: nothing later will be trained
            break
        if heads is not None:  # this rank's messages of two rounds back are trained before this one is captured
            t_serve = time.monotonic()
            eval0, served0 = tx.idle_work_s, heads.busy_s
            heads.serve_through(j - 2 * topo.num_drafters, idle=tx.idle_between, stop_limit=stop_limit)
            # waiting = this time less the evaluation and the GPU time of the requests served meanwhile (read as
            # their events complete: a little can land in a later wait)
            tx.wait_s += max(0.0, time.monotonic() - t_serve - (tx.idle_work_s - eval0) - (heads.busy_s - served0))
        if evaluator is not None:
            evaluator.poll()
        k = job.start_cursor + j
        batch = [dataset[i] for i in job.plan[k]]
        traced = tracer.wants(j)
        if traced:
            tracer.start()
        if d.device.type == "cuda":
            # Work already queued on the compute stream is not this message's forward: counted as waiting
            t_stall = time.monotonic()
            tx.wait_event(torch.cuda.current_stream().record_event())
            stall_s += time.monotonic() - t_stall
        t_busy = time.monotonic()
        stall_msg = t_busy - t_stall if d.device.type == "cuda" else 0.0
        stall_if_due(fault, sent)
        with phase("capture"):
            ids, lengths, packed_ids, packed_mask = pad_batch(batch, d.device, packed)
            feats = apply_target_fault(fault, sent, capture(ids, lengths))
            if d.device.type == "cuda":  # busy time = real forward time; ready payloads are posted meanwhile
                tx.wait_event(torch.cuda.current_stream().record_event())
        capture_msg = time.monotonic() - t_busy
        busy_s += capture_msg
        cu = torch.zeros(len(batch) + 1, dtype=torch.long)
        cu[1:] = lengths.cumsum(0)
        msg = Message(k, torch.tensor(job.plan[k], dtype=torch.long), cu, packed_ids, packed_mask, feats)
        tokens += int(lengths.sum())
        samples += len(batch)
        flops += flops_per_batch(lengths.tolist())
        waited, evaluated, wall = tx.wait_s, tx.idle_work_s, time.monotonic() - start
        with phase("send"):
            tx.send(topo.drafter_for(j), msg, stats=stats())
        sent += 1
        if heads is not None:
            heads.expect(j, k, topo.drafter_for(j))
        if traced:
            tracer.finish()
        if trace is not None:
            trace.write(json.dumps({"message": k, "from": d.rank, "from_node": topo.node_of(d.rank),
                                    "to": topo.drafter_for(j), "to_node": topo.node_of(topo.drafter_for(j)),
                                    "samples": len(batch),
                                    "tokens": int(lengths.sum()), "t_s": round(wall, 4),
                                    "stall_ms": round(stall_msg * 1e3, 3), "capture_ms": round(capture_msg * 1e3, 3),
                                    "backpressure_ms": round((tx.wait_s - waited) * 1e3, 3),
                                    "eval_ms": round((tx.idle_work_s - evaluated) * 1e3, 3)}) + "\n")
        if not steady and tx.all_took(WARM_MESSAGES):  # drafters past warm-up: steady-state timeout from here
            steady = True
            channel.timeout_s = cfg.topology.timeout_s
            if heads is not None:
                heads.ch.timeout_s = heads.replies.timeout_s = cfg.topology.timeout_s
            shorten_timeouts(d, cfg.topology.timeout_s)
    if heads is not None:  # the replies of the last steps (none of a stopped job's untrained messages)
        heads.finish(idle=tx.idle_between, stop_limit=stop_limit)
    for dr in topo.drafter_ranks:
        tx.send_end(dr, stats=stats())
    tx.flush()
    wall = time.monotonic() - start
    if evaluator is not None:
        serve_last_evaluations(job, evaluator, stopped)
    capture.close()
    if trace is not None:
        trace.close()
    log.info("target %s: %d messages, %d samples, %d tokens in %.1f s (%.0f tok/s, busy %.0f%%, "
             "backpressure wait %.0f%%, stream stall before a capture %.0f%%, evaluation while waiting %.0f%%)%s",
             "stopped" if stopped else "done", sent, samples, tokens, wall, tokens / max(wall, 1e-9),
             100 * busy_s / max(wall, 1e-9), 100 * tx.wait_s / max(wall, 1e-9), 100 * stall_s / max(wall, 1e-9),
             100 * tx.idle_work_s / max(wall, 1e-9),
             f"; {heads.describe()} = {100 * heads.busy_s / max(wall, 1e-9):.0f}% of the time" if heads else "")
