"""The batching plan: the held-out split and length-bucketed messages of whole samples (independent of the
split of ranks)."""

from __future__ import annotations

import random
from typing import Iterable, Sequence, Union

from torch import Tensor

from dflash_dist.data.conversations import DataError

HOLDOUT_MAX_FRACTION = 0.1


def holdout_size(n_conversations: int, requested: int) -> int:
    """Conversations held out: ``data.holdout``, at most 10% of the data (rounded down: none for fewer than 10),
    so a small file still trains."""
    if requested < 0:
        raise DataError(f"data.holdout={requested} must be >= 0")
    return min(int(requested), int(n_conversations * HOLDOUT_MAX_FRACTION))


def split_holdout(n_conversations: int, holdout: int, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic split of ``range(n_conversations)`` into (train ids, holdout ids), both sorted."""
    if holdout < 0:
        raise DataError(f"holdout={holdout} must be >= 0")
    if holdout >= n_conversations:
        raise DataError(f"data.holdout={holdout} leaves no training data out of {n_conversations} conversations")
    held = sorted(random.Random(f"holdout:{seed}").sample(range(n_conversations), holdout))
    hs = set(held)
    return [i for i in range(n_conversations) if i not in hs], held


def _pack_window(window: list, lengths: Sequence[int], max_batch_tokens: int, max_batch_samples: int) -> list:
    window = sorted(window, key=lambda s: lengths[s])
    batches, cur, cur_max = [], [], 0
    for s in window:
        L = lengths[s]
        new_max = max(cur_max, L)
        if cur and (len(cur) + 1 > max_batch_samples or (len(cur) + 1) * new_max > max_batch_tokens):
            batches.append(cur)
            cur, new_max = [], L
        cur.append(s)
        cur_max = new_max
    if cur:
        batches.append(cur)
    return batches


def build_plan(lengths: Union[Tensor, Sequence[int]], sample_ids: Iterable[int], *, epochs: int, seed: int,
               max_batch_tokens: int, max_batch_samples: int, sort_window_batches: int = 32) -> list[list[int]]:
    """Batches (lists of sample ids) of all epochs, in order. ``lengths[s]`` is the length of sample ``s``.

    Per epoch: shuffle ``sample_ids`` with seed+epoch, cut into windows of ``32 * max_batch_samples``, sort each
    window by length, pack greedily so that ``n * max_len <= max_batch_tokens`` and ``n <= max_batch_samples``
    (a sample longer than the budget is a batch of its own), then shuffle the batches of the epoch. Depends
    only on its arguments; in particular not on the number of ranks.
    """
    if epochs < 0 or max_batch_tokens < 1 or max_batch_samples < 1:
        raise ValueError("build_plan needs epochs >= 0, max_batch_tokens >= 1 and max_batch_samples >= 1")
    lens = lengths.tolist() if isinstance(lengths, Tensor) else list(lengths)
    ids = sorted(int(s) for s in (sample_ids.tolist() if isinstance(sample_ids, Tensor) else sample_ids))
    if len(set(ids)) != len(ids):
        raise ValueError("build_plan: duplicate sample ids")
    if ids and (ids[0] < 0 or ids[-1] >= len(lens)):
        raise ValueError(f"build_plan: sample ids must be in [0, {len(lens)})")
    window = max(1, sort_window_batches) * max_batch_samples
    plan: list[list[int]] = []
    for epoch in range(epochs):
        rng = random.Random(f"plan:{seed}:{epoch}")
        order = list(ids)
        rng.shuffle(order)
        batches: list[list[int]] = []
        for w in range(0, len(order), window):
            batches.extend(_pack_window(order[w:w + window], lens, max_batch_tokens, max_batch_samples))
        rng.shuffle(batches)
        plan.extend(batches)
    return plan
