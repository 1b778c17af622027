"""A follower rank of a target replica (``target.tensor_parallel`` > 1) in the in-training evaluation: it runs the
verify forwards of every evaluation its feeder (the replica's first rank, ``TargetEval`` in eval/in_training.py)
runs, on the proposals the feeder shares over the replica's link (eval/replica.py), and reports nothing.
"""

from __future__ import annotations

import logging

from dflash_dist.eval.in_training import EVAL_REQUEST_PATIENCE_S, load_eval_prompts
from dflash_dist.eval.replica import RUN, ReplicaLink

log = logging.getLogger("dflash_dist")


class FollowerEval:
    """A follower rank of replica 0 (``target.tensor_parallel`` > 1): the verify forwards of every evaluation its
    feeder runs, on the feeder's proposals; nothing reported (the feeder posts the result)."""

    def __init__(self, job, model):
        self.job, self.model = job, model
        self.link = ReplicaLink(job)
        self.prompts, self.eos = load_eval_prompts(job)  # the feeder's prompts: the same file, the same subset
        self.steps = None  # the evaluation under way (a generator of verify steps, as the feeder's)
        self.runs = 0

    def at_boundary(self) -> None:
        """Where the feeder polls its evaluator between messages: start the evaluation it starts there, then run
        as many verify steps as it does (TargetEval._replica_slice)."""
        if self.link.boundary():
            self.steps = self._steps()
        while self.steps is not None and self.link.boundary():
            self._advance()

    def after_stream(self) -> None:
        """Join the evaluations the feeder runs to their end after the stream until it says there are no more
        (one it dropped, the job stopping early, is dropped here too). Each wait is bounded above the feeder's own
        (a first request: warmup_timeout_s; a later one: its patience; the weights: timeout_s)."""
        t = self.job.cfg.topology
        while self.link.next_after_stream(t.warmup_timeout_s + EVAL_REQUEST_PATIENCE_S + t.timeout_s) == RUN:
            self.steps = self.steps or self._steps()
            while self.steps is not None:
                self._advance()
        self.steps = None  # an evaluation the feeder dropped
        log.info("replica rank %d: ran the verify forwards of %d evaluation(s) with its feeder", self.job.dist.rank,
                 self.runs)

    def _steps(self):
        from dflash_dist.eval.spec_decode import evaluate_steps
        job = self.job
        b = job.drafter.block_size
        return evaluate_steps(self.model, self.link.receiving(b), None, None, self.prompts, job.layer_ids,
                              job.mask_token_id, b, job.cfg.train.eval_max_new_tokens, self.eos, check_lossless=False,
                              exclude_one_step=job.cfg.train.eval_exclude_one_step)

    def _advance(self) -> None:
        """One step of the evaluation under way, as the feeder's next(): its end is the feeder's end too."""
        try:
            next(self.steps)
        except StopIteration:
            self.steps = None
            self.runs += 1
