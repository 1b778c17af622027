"""The job's data, tokenized once into a content-keyed cache: the training samples, the held-out conversations and
what the build logged (a cache hit says it again). Rank-agnostic: the job runs it on rank 0 (``job.prepare_data``)."""

from __future__ import annotations

import json
import logging
import os
import time

from dflash_dist.config import DataConfig
from dflash_dist.data.conversations import BadDataStats, check_bad_fraction
from dflash_dist.data.sources import no_usable_data, prepare_conversations

log = logging.getLogger("dflash_dist")


def cache_paths(cache: str, key: str) -> tuple[str, str, str]:
    """The training samples, held-out conversations and build info of cache key ``key``."""
    return (os.path.join(cache, f"train-{key}.pt"), os.path.join(cache, f"holdout-{key}.jsonl"),
            os.path.join(cache, f"info-{key}.json"))


def build_dataset(data: DataConfig, cache: str, tok_path: str, vocab: int, key: str) -> tuple[str, str]:
    """Tokenize ``data`` into ``cache`` unless it is there (then report what its build logged); returns the paths
    of the training samples and the held-out conversations. Raises DataError for unusable data, a StorageError
    (one line: the path and the errno) when the disk refuses the cache."""
    from dflash_dist.storage import writing
    with writing(cache, "the tokenized data cache"):
        return _build_dataset(data, cache, tok_path, vocab, key)


def _build_dataset(data: DataConfig, cache: str, tok_path: str, vocab: int, key: str) -> tuple[str, str]:
    ds_path, ho_path, info_path = cache_paths(cache, key)
    if data.source.startswith("synthetic:"):
        if not os.path.exists(ds_path):
            from dflash_dist.data.synthetic import synthetic_dataset
            os.makedirs(cache, exist_ok=True)
            synthetic_dataset(data.source, vocab, data.max_length, data.shuffle_seed).save(ds_path)
            with open(ho_path, "w"):
                pass
        return ds_path, ho_path
    if all(os.path.exists(p) for p in (ds_path, ho_path, info_path)):
        cached_data_report(info_path, ds_path, data.max_bad_fraction)
        return ds_path, ho_path
    os.makedirs(cache, exist_ok=True)
    stats = BadDataStats()
    t0 = time.time()
    # streamed (two passes: count, then tokenize): the corpus is never in memory, only its tokens; an empty
    # source (no usable conversation) is one DataError naming it, its rows and why (data.sources)
    ds, held = prepare_conversations(data.source, data.holdout, data.shuffle_seed, tok_path,
                                     data.max_length, data.overlong, data.num_workers, stats,
                                     vocab_size=vocab, chat_template_kwargs=data.chat_template_kwargs)
    if len(ds) == 0:
        raise no_usable_data(data.source, stats)
    stats.check(data.max_bad_fraction)
    if stats.bad_rows or stats.notes:
        log.warning("data: %s", stats.summary())
    log.info("data: %d training samples, %d tokens (tokenized in %.1f s)", len(ds), int(ds.lengths.sum()),
             time.time() - t0)
    ds.save(ds_path)
    tmp = ho_path + ".tmp"
    with open(tmp, "w") as f:
        for conv in held:
            f.write(json.dumps(conv) + "\n")
    os.replace(tmp, ho_path)
    info = {"conversations": int(ds.meta["num_conversations"]) + len(held), "held_out": len(held),
            "samples": len(ds), "tokens": int(ds.lengths.sum()), "bad_fraction": stats.bad_fraction,
            "summary": stats.summary() if stats.bad_rows or stats.notes else ""}
    with open(info_path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(info_path + ".tmp", info_path)  # last: a cache is complete once its info is there

    return ds_path, ho_path


def cached_data_report(info_path: str, ds_path: str, max_bad_fraction: float) -> None:
    """A cache hit: the counts and bad-row summary its build logged, and ``data.max_bad_fraction`` applied to
    the cached data as to fresh data (the limit is not part of the cache key)."""
    with open(info_path) as f:
        info = json.load(f)
    log.info("data: %d conversations, %d held out for evaluation; %d training samples, %d tokens (tokenized "
             "earlier: the cache %s)", info["conversations"], info["held_out"], info["samples"], info["tokens"],
             ds_path)
    if info["summary"]:
        log.warning("data: %s", info["summary"])
    check_bad_fraction(info["bad_fraction"], max_bad_fraction, info["summary"])
