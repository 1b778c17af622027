"""The batch shapes a drafter's compiled kernels will see, planned before training.

A drafter batch is specialised on three sizes, (b, S_pad, Q): samples, context padded up to
``drafter.tuning.ctx_bucket``, and queries. The plan fixes which samples every step of every drafter trains, so
the shapes are known before the first message: the compile guard (``compile_guard.py``) allows exactly those
shapes to compile after warm-up, and ``DrafterTrainer.precompile`` runs dry steps of a few of them so that no
compile stalls training. Planning the shapes is kept apart from guarding the compiles: the plan is arithmetic on
sample lengths that mirrors ``blocks.make_batch``, the guard is process-wide torch settings and per-step checks.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Iterable, Iterator, Sequence

__all__ = ["batch_shape", "expected_shapes", "plan_step_lengths", "precompile_steps"]


def batch_shape(batch: Any) -> tuple[int, int, int]:
    """(b, S_pad, Q) of a ``blocks.DrafterBatch``: the three sizes the compiled kernels specialise on."""
    b, s_pad = int(batch.features.shape[0]), int(batch.features.shape[1])
    return b, s_pad, int(batch.block_ids.shape[1])


def expected_shapes(sample_lengths_per_step: Iterable[Sequence[int]], ctx_bucket: int, q_len: int
                    ) -> Counter:
    """Counter {(b, S_pad, Q): steps} of a drafter's steps, from the sample lengths of each of its messages
    (the plan is known before training: ``[[lengths[i] for i in job.plan[k]] for k in my_messages]``).

    Mirrors ``blocks.make_batch``: S_pad = max(1, ceil(max_len / ctx_bucket)) * ctx_bucket. An empty step
    (``drafter.trainer.empty_batch_inputs``, one 2-token sample) is ``[2]``."""
    out: Counter = Counter()
    for lens in sample_lengths_per_step:
        lens = list(lens)
        s_pad = max(1, math.ceil(max(lens) / ctx_bucket)) * ctx_bucket
        out[(len(lens), s_pad, int(q_len))] += 1
    return out


def plan_step_lengths(plan: Sequence[Sequence[int]], sample_lengths: Sequence[int], start_cursor: int,
                      run_messages: int, num_drafters: int, index: int) -> Iterator[list[int]]:
    """Sample lengths of every step of drafter ``index``, in order (``drafter.loop.run_drafter``'s schedule: step
    s trains message start_cursor + s*D + index, or an empty batch -- one 2-token sample -- past the end)."""
    steps = -(-run_messages // num_drafters)
    for s in range(steps):
        j = s * num_drafters + index
        if j < run_messages:
            yield [int(sample_lengths[i]) for i in plan[start_cursor + j]]
        else:
            yield [2]


def precompile_steps(sample_lengths_per_step: Iterable[Sequence[int]], ctx_bucket: int) -> list[list[int]]:
    """Sample lengths of the planned steps worth a dry run before training (``DrafterTrainer.precompile``):
    for one-sample batches and for batches of several (dynamo specialises a size of 1 apart), the first two
    context lengths S_pad of each (with dynamic shapes the second compiles the dynamic variant). On an H200
    the step that first had one sample compiled at step 8, for 27-34 s, while its target waited."""
    picked: dict[bool, list[int]] = {True: [], False: []}
    out: list[list[int]] = []
    for lens in sample_lengths_per_step:
        lens = [int(n) for n in lens]
        s_pad = max(1, math.ceil(max(lens) / ctx_bucket)) * ctx_bucket
        done = picked[len(lens) == 1]
        if s_pad not in done and len(done) < 2:
            done.append(s_pad)
            out.append(lens)
    return out
