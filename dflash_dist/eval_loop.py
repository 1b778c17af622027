"""Acceptance-length evaluation during training, on the target rank that is already loaded.

The leader (drafter rank 0) posts ``dflash/eval_req/<n>`` in the store and sends the drafter weights (one flat
tensor) to the first target rank. That target checks for requests between messages, receives the weights,
runs real greedy speculative decoding on held-out prompts (spec_decode.evaluate_prompts) and posts the result
as JSON under ``dflash/eval_res/<n>``; the leader logs it when it appears, next to the training accuracy and
the tau that accuracy predicts, so the train/serve gap is on the dashboard. No extra engine, no extra GPU.
"""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .drafter import DFlashDrafter, DrafterModelConfig
from .target import text_config

log = logging.getLogger("dflash_dist")
REQ, RES = "dflash/eval_req/", "dflash/eval_res/"
SKIP = "skip"  # request value of an evaluation the leader skipped
EVAL_TAG = 17  # gloo tag of the weights sent for evaluation (headers and errors use tag 0)


def _model_config(job) -> DrafterModelConfig:
    c = job.cfg
    return DrafterModelConfig.from_target(text_config(job.hf_config), num_layers=c.drafter.num_layers,
                                          num_feature_layers=len(job.layer_ids), block_size=c.drafter.block_size,
                                          intermediate_size=c.drafter.intermediate_size)


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


class LeaderEval:
    """Drafter rank 0: request evaluations and collect their results without blocking training."""

    def __init__(self, job, model):
        self.job, self.model = job, model
        self.store = job.dist.store
        self.dst = job.dist.topo.target_ranks[0]
        self.sent: list[int] = []      # request numbers sent, results not yet logged
        self.steps: dict[int, int] = {}
        self.n = 0
        self._inflight = None

    def request(self, step: int) -> None:
        """Send the current weights for evaluation, unless the previous evaluation is still running (then skip:
        never block training on it). The weights go over the host (gloo) channel with their own tag, never over
        the NCCL data group: an NCCL send there would queue in front of the next feature receives on the same
        communicator while the target waits for the drafter to take those features (a deadlock on GPU)."""
        from .spec_decode import pack_state
        if self._inflight is not None:
            prev = self._inflight[2]
            if not self.store.check([f"{RES}{prev}"]):
                log.warning("evaluation at step %d skipped: the one of step %d is still running", step,
                            self.steps[prev])
                self.store.set(f"{REQ}{self.n}", SKIP)  # the target counts it and expects no weights
                self.n += 1
                return
            self._inflight[0].wait()  # the target took the weights (its result exists): returns at once
        flat = pack_state(self.model).cpu()
        self.store.set(f"{REQ}{self.n}", str(step))
        self._inflight = (dist.isend(flat, self.dst, group=self.job.dist.ctrl, tag=EVAL_TAG), flat, self.n)
        self.sent.append(self.n)
        self.steps[self.n] = step
        self.n += 1

    def ready(self, block_s: float = 0.0) -> list[tuple[int, dict]]:
        """Results that have arrived (optionally waiting up to block_s for all outstanding ones)."""
        out = []
        deadline = time.monotonic() + block_s
        for n in list(self.sent):
            key = f"{RES}{n}"
            if block_s > 0:
                try:
                    self.store.wait([key], timedelta(seconds=max(1.0, deadline - time.monotonic())))
                except Exception:
                    log.warning("evaluation %d (step %d) did not finish in time", n, self.steps[n])
                    continue
            elif not self.store.check([key]):
                continue
            self.sent.remove(n)
            out.append((self.steps[n], json.loads(self.store.get(key).decode())))
        return out


class TargetEval:
    """First target rank: serve evaluation requests. ``slices``: an evaluation is started between messages and
    advanced one verify step per :meth:`work` call (the Sender calls it while waiting for the drafters);
    otherwise each runs whole when :meth:`poll` finds it."""

    def __init__(self, job, model, slices: bool = False):
        from transformers import AutoTokenizer
        from .data import DataError
        from .evaluate import encode_prompts, eos_token_ids, prompts_from_jsonl
        self.job, self.model, self.slices = job, model, slices
        self.store = job.dist.store
        self.n = 0  # requests taken
        self.running = None  # [request number, step, generator, slices run, taken at, weights seconds]
        c = job.cfg
        self.drafter = DFlashDrafter(_model_config(job), "sdpa").to(job.dist.device).eval()
        self.numel = sum(v.numel() for v in self.drafter.state_dict().values())
        tok = AutoTokenizer.from_pretrained(job.tokenizer_path)
        try:
            convs = prompts_from_jsonl(job.holdout_path)[: c.train.eval_prompts]
        except (DataError, OSError, ValueError):
            convs = []
        self.prompts = encode_prompts(tok, convs) if convs else []
        self.eos = eos_token_ids(tok, job.hf_config)
        if not self.prompts:
            log.warning("evaluation requested but there are no held-out prompts (data.holdout=0?)")

    def poll(self, wait_s: float = 0.0, whole: bool = False) -> bool:
        """Take the next request if it is there (or arrives within wait_s): a skipped one is counted; a real one
        is started (slices) or run whole (no slices, or ``whole``). True if one was taken. While one is running the
        leader only posts skips."""
        key = f"{REQ}{self.n}"
        if wait_s > 0:
            try:
                self.store.wait([key], timedelta(seconds=wait_s))
            except Exception:
                return False
        elif not self.store.check([key]):
            return False
        from .spec_decode import evaluate_steps, unpack_state_
        value = self.store.get(key).decode()
        if value == SKIP:
            self.n += 1
            return True
        if self.running is not None:  # the leader sends weights only after the previous result
            raise RuntimeError(f"evaluation request {self.n} came while request {self.running[0]} is still running")
        step = int(value)
        t0 = time.monotonic()
        flat = torch.empty(self.numel, dtype=torch.float32)  # host: the weights travel on the gloo channel
        dist.recv(flat, self.job.dist.topo.drafter_ranks[0], group=self.job.dist.ctrl, tag=EVAL_TAG)
        unpack_state_(self.drafter, flat)
        c = self.job.cfg
        gen = evaluate_steps(self.model, self.drafter, None, None, self.prompts, self.job.layer_ids,
                             self.job.mask_token_id, c.drafter.block_size, c.train.eval_max_new_tokens, self.eos,
                             check_lossless=False)
        self.running = [self.n, step, gen, 0, t0, time.monotonic() - t0]
        self.n += 1
        if whole or not self.slices:
            self.finish()
        return True

    def work(self) -> bool:
        """One verify step of the running evaluation; False if none is running."""
        if self.running is None:
            return False
        self.running[3] += 1
        try:
            next(self.running[2])
        except StopIteration as e:
            self._post(e.value)
        return True

    def finish(self) -> None:
        """Run the evaluation in progress (if any) to its end."""
        from .spec_decode import run_to_end
        if self.running is not None:
            self._post(run_to_end(self.running[2]))

    def _post(self, r: dict) -> None:
        n, step, _, slices, t0, recv_s = self.running
        self.running = None
        res = {"step": step, "n_prompts": 0, "seconds": r["wall_s"], "weights_s": recv_s,
               "span_s": time.monotonic() - t0, "slices": slices}
        if self.prompts:
            res.update({"tau": r["tau"], "n_prompts": r["n_prompts"],
                        "per_position_acceptance": r["per_position_acceptance"]})
        self.store.set(f"{RES}{n}", json.dumps(res))
        log.info("evaluation at step %d: tau %.3f on %d held-out prompts (%.1f s of target time%s; weights "
                 "received in %.1f s)", step, res.get("tau", float("nan")), res["n_prompts"], res["seconds"],
                 f" in {slices} slices over {res['span_s']:.1f} s" if slices else "", recv_s)


def eval_record(result: dict, train_window: dict | None) -> dict:
    rec = {"tau": result.get("tau"), "n_prompts": result.get("n_prompts"), "eval_seconds": result.get("seconds"),
           "eval_span_s": result.get("span_s"), "eval_slices": result.get("slices"),
           "eval_weights_s": result.get("weights_s")}
    for k, v in enumerate(result.get("per_position_acceptance") or [], start=1):
        rec[f"accept_pos_{k}"] = v
    if train_window:
        rec["train_acc"] = train_window.get("acc")
        rec["tau_from_train_acc"] = train_window.get("tau_from_acc")
        if rec["tau"] is not None and rec["tau_from_train_acc"]:
            rec["train_serve_gap"] = rec["tau_from_train_acc"] - rec["tau"]
    return rec
