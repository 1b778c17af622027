"""Acceptance-length evaluation during training, on the target rank that is already loaded.

The leader (drafter rank 0) posts ``dflash/eval_req/<n>`` in the store and keeps the drafter weights ready (one flat
tensor on its device: bf16 on GPU). The first target takes the request between messages, posts its receive on the
``evals`` group and says so under ``dflash/eval_ready/<n>``; the leader sends at its next step (a rendezvous: no
send waits on either GPU for a receive that is not there). The target then runs real greedy speculative decoding
on held-out prompts (spec_decode.evaluate_steps), a verify step at a time while it waits for its drafters
(``train.tuning.eval_in_slices``) or whole, and posts the result as JSON under ``dflash/eval_res/<n>``; the leader logs it
when it appears, next to the training accuracy and the tau that accuracy predicts, so the train/serve gap is on
the dashboard. No extra engine, no extra GPU. On a target replica (``target.tensor_parallel`` > 1) the first
target's followers run every verify forward with it (``FollowerEval``, eval/follower.py), at message boundaries.
An evaluation run whole is abandoned at the next prompt once a graceful stop is requested (SIGTERM: the checkpoint
does not need it); its result says so and leaves no record in metrics.jsonl.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from dflash_dist.comm.faults import fault_for, slow_eval_if_due
from dflash_dist.eval.replica import DONE, RUN, ReplicaLink, whole_head

log = logging.getLogger("dflash_dist")
REQ, READY, RES = "dflash/eval_req/", "dflash/eval_ready/", "dflash/eval_res/"
CLOSED = "dflash/eval_closed"  # the target stopped early and takes no more requests
SKIP = "skip"  # request value of an evaluation the leader skipped
STOPPED = "stopped"  # result key of an evaluation abandoned on a graceful stop: why (e.g. "SIGTERM")
# what an evaluation's result carries from spec_decode's summary to the leader and metrics.jsonl
SUMMARY_KEYS = ("acceptance_length", "tau_pooled", "tau", "tau_stderr", "tau_all_prompts", "n_prompts",
                "max_new_tokens", "prompts_one_step", "prompts_in_tau", "one_step_excluded")
# how long the target waits for the leader's next evaluation request after its stream (each request restarts it)
EVAL_REQUEST_PATIENCE_S = 120.0


def wire_dtype(device: torch.device) -> torch.dtype:
    """dtype of the weights on their way to the evaluator: bf16 on GPU (half the bytes of fp32; a drafter is served
    in bf16), fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _await(done, job, what: str) -> None:
    """Poll ``done`` up to topology.timeout_s, running the liveness check (a dead peer ends the wait, named)."""
    from dflash_dist.comm.transport import poll_until
    if not poll_until(done, job.cfg.topology.timeout_s, job.life.check, max_sleep=1e-2):
        raise RuntimeError(f"timed out after {job.cfg.topology.timeout_s:.0f} s waiting for {what}")


def _completed(work, device: torch.device) -> bool:
    """gloo point-to-point works cannot say they are done before wait(): on CPU a wait is the answer."""
    if device.type == "cuda":
        return work.is_completed()
    work.wait()
    return True


def eval_enabled(job) -> bool:
    """train.eval_prompts > 0 and there are held-out prompts (synthetic data has none). Every rank decides the
    same from the shared data cache, so leader and target agree without talking."""
    if job.cfg.train.eval_prompts <= 0:
        return False
    try:
        return os.path.getsize(job.holdout_path) > 0
    except (OSError, TypeError):
        return False


def eval_steps(job) -> list[int]:
    """Steps (after the step counter is incremented) at which the leader requests an evaluation: every
    train.eval_every steps and after the last one. Known on every rank from the plan alone."""
    D = job.dist.topo.num_drafters
    steps = -(-(job.total_messages - job.start_cursor) // D)
    last = job.start_step + steps
    every = job.cfg.train.eval_every
    out = [s for s in range(job.start_step + 1, last) if every and s % every == 0]
    return out + [last]


def expected_evals(job) -> int:
    return len(eval_steps(job))


def connect(job, leader: bool) -> None:
    """One small message on the ``evals`` group at startup, both ends at once: NCCL creates a group's
    communicator at its first operation, blocking until the peer joins, so a receive posted first during training
    would block the target until the leader's next step. A colocated leader is its own first target: nothing to
    connect (the weights cross its in-process link)."""
    if job.local is not None:
        return
    t = torch.ones(1, device=job.dist.device)
    if leader:
        dist.send(t, job.dist.topo.feeders[0], group=job.dist.evals)
    else:
        dist.recv(t, job.dist.topo.drafter_ranks[0], group=job.dist.evals)


@dataclass
class _Request:
    """Leader side: an evaluation requested, its weights until the result is in, their send once posted."""
    n: int
    flat: Optional[torch.Tensor]
    send: Any = None


@dataclass
class _Receiving:
    """Target side: a request taken, its weights' receive posted."""
    n: int
    step: int
    flat: torch.Tensor
    work: Any
    taken_at: float


@dataclass
class _Running:
    """Target side: an evaluation under way (a generator of verify steps)."""
    n: int
    step: int
    steps: Any
    taken_at: float
    weights_s: float
    slices: int = 0
    prompts_done: int = 0


class LeaderEval:
    """Drafter rank 0: request evaluations and collect their results without blocking training."""

    def __init__(self, job, model):
        self.job, self.model = job, model
        self.store = job.dist.store
        self.dst = job.dist.topo.feeders[0]
        self.sent: list[int] = []      # requests made, results not yet logged
        self.steps: dict[int, int] = {}
        self.n = 0
        self._inflight: Optional[_Request] = None  # the last request (None before the first)
        self._immediate = job.local is not None or dist.get_backend(job.dist.evals) == "gloo"  # see pump
        self.last_step = max(eval_steps(job))
        self._deferred = None  # the last step's evaluation, while the one before it still runs: never skipped
        connect(job, leader=True)

    def request(self, step: int, weights: Optional[dict] = None) -> None:
        """Request an evaluation of the current weights, unless the previous one is still running (then skip:
        never block training on it). ``weights``: the whole state gathered from a sharded drafter (FSDP), on the
        host; None: the model's own."""
        from dflash_dist.eval.spec_decode import pack_state
        if self._inflight is not None:
            prev = self._inflight.n
            if not self.store.check([f"{RES}{prev}"]):
                if step == self.last_step:
                    self._deferred = step  # requested by ready() once the running one is done
                    return
                log.warning("evaluation at step %d skipped: the one of step %d is still running%s", step,
                            self.steps[prev], " (on the target's idle time; train.tuning.eval_in_slices=false runs each "
                            "whole, pausing training)" if self.job.cfg.train.tuning.eval_in_slices else "")
                self.store.set(f"{REQ}{self.n}", SKIP)  # the target counts it and expects no weights
                self.n += 1
                return
            self._inflight = None  # its weights arrived (the result exists)
        flat = pack_state(self.model if weights is None else weights, wire_dtype(self.job.dist.device))
        flat = flat.to(self.job.dist.device)
        self.store.set(f"{REQ}{self.n}", str(step))
        self._inflight = _Request(self.n, flat)
        self.sent.append(self.n)
        self.steps[self.n] = step
        self.n += 1
        self.pump()

    def pump(self) -> None:
        """Send the requested weights once the target has posted its receive (called every step). Over gloo they
        go at once: a pending gloo send holds no GPU, and a target that blocks on the receive gets them."""
        r = self._inflight
        if r is not None and r.send is None and (self._immediate or self.store.check([f"{READY}{r.n}"])):
            local = self.job.local
            r.send = (local.post_weights(r.flat) if local is not None
                      else dist.isend(r.flat, self.dst, group=self.job.dist.evals))

    def ready(self, block_s: float = 0.0) -> list[tuple[int, dict]]:
        """Results that have arrived (optionally waiting up to block_s for all outstanding ones, sending the
        weights the target asks for meanwhile)."""
        out = []
        deadline = time.monotonic() + block_s
        while True:
            self.pump()
            for n in list(self.sent):
                if self.store.check([f"{RES}{n}"]):
                    self.sent.remove(n)
                    if self._inflight is not None and self._inflight.n == n:
                        self._inflight.flat = None  # the target has the weights: free the copy (2 GB at 1B bf16)
                    res = json.loads(self.store.get(f"{RES}{n}").decode())
                    if STOPPED not in res:  # one abandoned on a graceful stop is no result (the target logged it)
                        out.append((self.steps[n], res))
            if self._deferred is not None and not self.sent:
                step, self._deferred = self._deferred, None
                self.request(step)
            if not self.sent or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        for n in self.sent if block_s > 0 else []:
            log.warning("evaluation %d (step %d) did not finish in time", n, self.steps[n])
        return out

    def close(self) -> None:
        """The job stops early: a receive the target posted for requested weights must not be left unmatched
        (NCCL would hold it at exit). Wait until the target has either posted it (then send) or closed."""
        if self._inflight is None or self._inflight.send is not None:
            return
        n = self._inflight.n
        _await(lambda: self.store.check([f"{READY}{n}"]) or self.store.check([CLOSED]), self.job,
               "the first target to take or drop the evaluation request")
        self.pump()


def load_eval_prompts(job) -> tuple[list, list]:
    """(encoded held-out prompts, eos ids) of every in-training evaluation: train.eval_prompts of them spread over
    the held-out file (empty, with a warning, if there are none)."""
    from transformers import AutoTokenizer

    from dflash_dist.data.conversations import DataError
    from dflash_dist.eval.prompts import encode_prompts, eos_token_ids, prompts_from_jsonl, spread_subset
    c = job.cfg
    tok = AutoTokenizer.from_pretrained(job.tokenizer_path)
    try:
        convs = spread_subset(prompts_from_jsonl(job.holdout_path), c.train.eval_prompts)
    except (DataError, OSError, ValueError):
        convs = []
    prompts = encode_prompts(tok, convs, c.data.chat_template_kwargs or None) if convs else []
    if not prompts:
        log.warning("evaluation requested but there are no held-out prompts (data.holdout=0?)")
    return prompts, eos_token_ids(tok, job.hf_config)


class TargetEval:
    """First target rank: serve evaluation requests. ``slices``: an evaluation is started between messages and
    advanced one verify step per :meth:`work` call (the Sender calls it while waiting for the drafters);
    otherwise each runs whole when :meth:`poll` finds it."""

    def __init__(self, job, model, slices: bool = False):
        self.job, self.model, self.slices = job, model, slices
        self.store = job.dist.store
        self.n = 0  # requests taken
        self.receiving: Optional[_Receiving] = None
        self.running: Optional[_Running] = None
        # a replica of k ranks: its followers run every verify forward with this rank (eval/replica.py)
        self.link = ReplicaLink(job) if job.dist.topo.tp > 1 else None
        if self.link is not None and slices:
            raise ValueError("a replica's evaluation runs between messages (its followers join it there)")
        self._stream_since = time.monotonic()  # the end of the last message boundary (a replica's slices)
        self.fault = fault_for(job.dist.rank)  # the failure tests' slow evaluation (comm/faults.py)
        connect(job, leader=False)
        # the job's variant and shape (model/spec.py), sdpa: the decode step's shapes change every block
        self.drafter = job.drafter.build_model("sdpa").to(job.dist.device).eval()
        self.embed, self.head = whole_head(job, model)
        self.numel = sum(v.numel() for v in self.drafter.state_dict().values())
        self.prompts, self.eos = load_eval_prompts(job)
        # prompts decoded together: only where an evaluation runs whole, not with a replica's followers
        self.batch = job.cfg.train.eval_batch_size if not slices and self.link is None else 1
        if self.batch > 1:
            from dflash_dist.config import ConfigError
            from dflash_dist.eval.batched import check_batchable
            try:
                check_batchable(model)
            except ValueError as e:
                raise ConfigError(f"train.eval_batch_size={self.batch}: {e}") from None

    def poll(self, wait_s: float = 0.0, whole: bool = False) -> bool:
        """Between messages: take the next request if it is there (or arrives within wait_s; True if one was
        taken). Without slices, an evaluation whose weights are in runs whole here; ``whole`` (after the stream,
        while the leader waits for results) also waits for the weights. With slices, :meth:`work` runs it."""
        took = self._take(wait_s)
        if whole:
            self.finish()
        elif self.link is not None:  # a replica: its followers join in at this boundary
            self._replica_slice()
        elif not self.slices:
            if self.receiving is not None and _completed(self.receiving.work, self.job.dist.device):
                self._start()
            if self.running is not None:  # never waits here for weights: the leader may be waiting for a message
                self.finish()
        return took

    def _replica_slice(self) -> None:
        """A replica's evaluation at a message boundary, its followers in step (each decision broadcast): it starts
        here once its weights are in, then runs verify steps for as long as the stream's own work took since the
        last boundary, at least one. So it takes about half the target's time while it runs, and a drafter waits
        about one message longer for its next."""
        budget = time.monotonic() - self._stream_since
        start = self.receiving is not None and _completed(self.receiving.work, self.job.dist.device)
        self.link.boundary(start)
        if start:
            self._start()
        deadline, first = time.monotonic() + budget, True
        while self.running is not None:
            go = first or time.monotonic() < deadline
            if not self.link.boundary(go):
                break
            first = False
            self.running.slices += 1
            try:
                next(self.running.steps)
            except StopIteration as e:
                self._post(e.value)
        self._stream_since = time.monotonic()

    def _take(self, wait_s: float) -> bool:
        """A skipped request is counted; for a real one the weights' receive is posted and announced (the leader
        sends once it sees that). While one is running the leader only posts skips."""
        key = f"{REQ}{self.n}"
        if wait_s > 0:
            try:
                self.store.wait([key], timedelta(seconds=wait_s))
            except Exception:
                return False
        elif not self.store.check([key]):
            return False
        value = self.store.get(key).decode()
        if value == SKIP:
            self.n += 1
            return True
        if self.running is not None or self.receiving is not None:  # the leader waits for the previous result
            raise RuntimeError(f"evaluation request {self.n} came while another is still running")
        flat = torch.empty(self.numel, dtype=wire_dtype(self.job.dist.device), device=self.job.dist.device)
        local = self.job.local
        work = (local.take_weights(flat) if local is not None
                else dist.irecv(flat, self.job.dist.topo.drafter_ranks[0], group=self.job.dist.evals))
        self.store.set(f"{READY}{self.n}", "1")
        self.receiving = _Receiving(self.n, int(value), flat, work, time.monotonic())
        self.n += 1
        return True

    def _start(self) -> None:
        from dflash_dist.eval.spec_decode import evaluate_steps, make_dflash_draft_fn, unpack_state_
        r, self.receiving = self.receiving, None
        if r.flat.device.type == "cuda":
            r.work.wait()  # the current stream waits for the receive (complete on the host's view; gloo: waited)
        unpack_state_(self.drafter, r.flat)
        c = self.job.cfg
        drafter = self.drafter
        if self.link is not None:  # the proposals reach the followers, which verify them with this rank
            drafter = self.link.broadcasting(make_dflash_draft_fn(self.drafter, self.embed, self.head))
        steps = evaluate_steps(self.model, drafter, self.embed, self.head, self.prompts, self.job.layer_ids,
                               self.job.mask_token_id, self.job.drafter.block_size, c.train.eval_max_new_tokens, self.eos,
                               check_lossless=False, exclude_one_step=c.train.eval_exclude_one_step,
                               progress=self._prompt_done, batch_size=self.batch)
        self.running = _Running(r.n, r.step, steps, r.taken_at, time.monotonic() - r.taken_at)

    def _prompt_done(self, done: int, total: int) -> None:
        self.running.prompts_done = done
        slow_eval_if_due(self.fault, self.running.n)

    def work(self) -> bool:
        """One piece of the evaluation in progress: start it once its weights are in, or run one verify step.
        False if there was nothing to do."""
        if self.receiving is not None:
            if not _completed(self.receiving.work, self.job.dist.device):
                return False
            self._start()
            return True
        if self.running is None:
            return False
        self.running.slices += 1
        try:
            next(self.running.steps)
        except StopIteration as e:
            self._post(e.value)
        return True

    def finish(self) -> None:
        """Run the evaluation in progress (if any) to its end, waiting for its weights first (only where the leader
        sends them without waiting for this rank: gloo, or the leader waiting for results). A graceful stop
        abandons it at the next prompt, except on a replica (its followers run every verify step with this rank)."""
        from dflash_dist.eval.spec_decode import run_to_end
        if self.receiving is not None:
            self._await_weights()
        if self.link is not None and (self.receiving is not None or self.running is not None):
            self.link.post(RUN)  # after the stream a replica's followers wait in the store (eval/replica.py)
        if self.receiving is not None:
            self._start()
        if self.running is not None and self.link is not None:
            self._post(run_to_end(self.running.steps))
        elif self.running is not None:
            self._run_unless_stopped()

    def _run_unless_stopped(self) -> None:
        """The evaluation in progress to its end, a graceful stop checked before each prompt: once one is requested
        the evaluation is abandoned there (the checkpoint does not wait for it) and its result says only that."""
        run, checked = self.running, -1
        while True:
            if run.prompts_done != checked:  # a prompt boundary (the next prompt's prefill may have run)
                checked = run.prompts_done
                reason = self.job.life.stop_reason()
                if reason is not None:
                    run.steps.close()
                    self.running = None
                    self.store.set(f"{RES}{run.n}", json.dumps({"step": run.step, STOPPED: reason}))
                    log.warning("evaluation at step %d stopped after %d/%d prompts: %s (no result recorded)",
                                run.step, run.prompts_done, len(self.prompts), reason)
                    return
            try:
                next(run.steps)
            except StopIteration as e:
                self._post(e.value)
                return

    def done(self) -> None:
        """No more evaluations on this rank (after the stream): a replica's followers stop waiting for them."""
        if self.link is not None:
            self.link.post(DONE)

    def close(self) -> None:
        """The job stops early: take no more requests, and let a posted receive complete (its READY came before
        CLOSED, so the leader sends), so no NCCL receive is left unmatched at exit. The evaluation is dropped."""
        self.store.set(CLOSED, "1")
        if self.receiving is not None:
            self._await_weights()
        self.receiving = self.running = None

    def _await_weights(self) -> None:
        _await(lambda: _completed(self.receiving.work, self.job.dist.device), self.job,
               "the leader drafter's weights for an evaluation")

    def _post(self, r: dict) -> None:
        run, self.running = self.running, None
        n, step, slices, recv_s = run.n, run.step, run.slices, run.weights_s
        res = {"step": step, "n_prompts": 0, "seconds": r["wall_s"], "weights_s": recv_s,
               "span_s": time.monotonic() - run.taken_at, "slices": slices}
        if self.prompts:
            res.update({k: r.get(k) for k in SUMMARY_KEYS})
            res.update({"per_position_acceptance": r["per_position_acceptance"],
                        "acceptance_lengths": [p["acceptance_lengths"] for p in r["per_prompt"]]})
        self.store.set(f"{RES}{n}", json.dumps(res))
        log.info("evaluation at step %d: acceptance length %.3f (pooled over verify steps), z-lab's tau %.3f (mean "
                 "over prompts%s) on %d held-out prompts (%s ended in their first block; max %s new tokens; %.1f s of "
                 "target time%s; weights in after %.1f s)", step, _nan(res.get("acceptance_length")),
                 _nan(res.get("tau")), ", those left out" if res.get("one_step_excluded") else "", res["n_prompts"],
                 res.get("prompts_one_step"), res.get("max_new_tokens"), res["seconds"],
                 f" in {slices} slices over {res['span_s']:.1f} s" if slices else "", recv_s)


def _nan(x) -> float:
    return float("nan") if x is None else x


def eval_record(result: dict, train_window: dict | None) -> dict:
    """The metrics.jsonl record of an evaluation: ``acceptance_length`` (pooled, the headline) first, z-lab's
    ``tau`` beside it; ``train_serve_gap``: the acceptance length the training accuracy predicts (a per-step
    figure) minus the pooled one measured. The training accuracy is that of the proposals the variant serves
    (``served_acc``, ``tau_from_served_acc``) where its metrics give them, else the head's argmax's."""
    rec = {k: result.get(k) for k in SUMMARY_KEYS}
    rec.update({"eval_seconds": result.get("seconds"), "eval_span_s": result.get("span_s"),
                "eval_slices": result.get("slices"), "eval_weights_s": result.get("weights_s"),
                "acceptance_lengths": result.get("acceptance_lengths")})  # per prompt, as dflash-eval's per_prompt
    for k, v in enumerate(result.get("per_position_acceptance") or [], start=1):
        rec[f"accept_pos_{k}"] = v
    if train_window:
        rec["train_acc"] = train_window.get("served_acc", train_window.get("acc"))
        rec["tau_from_train_acc"] = train_window.get("tau_from_served_acc", train_window.get("tau_from_acc"))
        if rec["acceptance_length"] is not None and rec["tau_from_train_acc"]:
            rec["train_serve_gap"] = rec["tau_from_train_acc"] - rec["acceptance_length"]
    return rec
