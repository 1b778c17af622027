"""Where conversations come from: ``data.source`` in every form users have it, read as a stream.

``data.source`` may be

- ``builtin``: the packaged corpus (``conversations.builtin_conversations``);
- a JSONL file (``.jsonl``, ``.ndjson``): read line by line, one row at a time, as ``conversations.py`` does;
- a ``.parquet`` or ``.arrow`` file (what ``datasets`` writes: ``to_parquet``, the shards of ``save_to_disk``):
  read a record batch at a time with pyarrow, never the whole file in memory;
- a ``.json`` file: through the HF ``datasets`` library (streaming; a file holding one top-level array is parsed
  whole: use JSONL or parquet for corpora larger than RAM);
- a directory written by ``datasets.Dataset.save_to_disk`` (or a ``DatasetDict``'s: its ``train`` split, else
  its only split): memory-mapped Arrow, iterated row by row;
- a directory of ``.parquet`` / ``.arrow`` / ``.jsonl`` / ``.json`` files (all of one kind, in name order).

Every row may be an OpenAI-style ``{"messages": [{"role", "content"}]}`` row or a ShareGPT row
``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}``; ShareGPT rows are mapped to messages
(``human``/``user`` -> user, ``gpt``/``assistant``/``chatgpt``/``bard``/``bing``/``model`` -> assistant,
``system`` -> system; any other ``from`` stays as it is and is counted ``unknown_role``). Bad rows are counted in
``BadDataStats`` per reason with their location (``file:line`` for JSONL, ``file:row N`` for the others, N
counted from 1), exactly as the JSONL reader does; only an unreadable source raises ``DataError``.

:func:`iter_conversations` yields the valid conversations one by one; :func:`read_conversations` is its list.
:func:`tokenize_stream` tokenizes such a stream with bounded memory (a window of conversations in flight; the
result holds only the int32 tokens and the mask bits).
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Iterable, Iterator, Optional

from dflash_dist.data.conversations import (
    PACKAGED_SOURCES,
    BadDataStats,
    DataError,
    builtin_conversations,
    iter_jsonl_objects,
    validate_conversation,
)

log = logging.getLogger("dflash_dist")

JSONL_SUFFIXES = (".jsonl", ".ndjson")
DATASETS_SUFFIXES = {".json": "json", ".parquet": "parquet", ".arrow": "arrow"}

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
                  "system": "system"}


# ----------------------------------------------------------------------------------------------- rows

def normalize_row(obj: Any) -> Any:
    """A ShareGPT row as a messages row (other keys kept); anything else unchanged (validation judges it).

    A turn that is not an object, or lacks ``from``/``value``, is passed on without the missing key so that
    ``validate_conversation`` counts it under the same reasons as a messages row (missing_role, ...)."""
    if not isinstance(obj, dict) or "messages" in obj or "conversations" not in obj:
        return obj
    turns = obj["conversations"]
    if not isinstance(turns, list):
        return {**{k: v for k, v in obj.items() if k != "conversations"}, "messages": turns}
    msgs = []
    for t in turns:
        if not isinstance(t, dict):
            msgs.append(t)
            continue
        m = {}
        if "from" in t:
            f = t["from"]
            m["role"] = SHAREGPT_ROLES.get(f.strip().lower(), f) if isinstance(f, str) else f
        if "value" in t:
            m["content"] = t["value"]
        msgs.append(m)
    out = {k: v for k, v in obj.items() if k != "conversations"}
    out["messages"] = msgs
    return out


def _validated(obj: Any, where: str, stats: BadDataStats) -> Optional[dict]:
    conv, reason, detail = validate_conversation(normalize_row(obj))
    if conv is None:
        stats.bad(reason, where, detail)
        return None
    conv["source"] = where
    return conv


# ----------------------------------------------------------------------------------------------- readers

def _iter_jsonl(path: str, stats: BadDataStats) -> Iterator[dict]:
    for where, obj in iter_jsonl_objects(path, stats):
        conv = _validated(obj, where, stats)
        if conv is not None:
            yield conv


def _datasets():
    try:
        import datasets
    except ImportError as e:  # a declared dependency; only a broken install lands here
        raise DataError("reading .json/.parquet/.arrow files and save_to_disk directories needs the `datasets` "
                        "package: pip install datasets") from e
    datasets.disable_progress_bars()
    return datasets


def _iter_rows(ds, where_of, stats: BadDataStats) -> Iterator[dict]:
    try:
        for i, row in enumerate(ds):
            stats.add_rows(1)
            conv = _validated(row, where_of(i), stats)
            if conv is not None:
                yield conv
    except DataError:
        raise
    except Exception as e:  # a corrupt file or a schema that changes between batches
        raise DataError(f"cannot read data source: {type(e).__name__}: {e}") from e


def _iter_arrow_batches(path: str, builder: str, stats: BadDataStats, batch_rows: int = 256) -> Iterator[dict]:
    """Parquet (``iter_batches``) or Arrow IPC (file or stream format, memory-mapped) a record batch at a time:
    the memory is one batch of ``batch_rows`` rows, whatever the file's size."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def batches():
        if builder == "parquet":
            yield from pq.ParquetFile(path).iter_batches(batch_size=batch_rows)
            return
        source = pa.memory_map(path, "r")
        try:
            reader = pa.ipc.open_file(source)
            for k in range(reader.num_record_batches):
                yield reader.get_batch(k)
        except pa.ArrowInvalid:  # datasets writes the stream format
            source.seek(0)
            yield from pa.ipc.open_stream(source)

    i = 0
    try:
        for rb in batches():
            for row in rb.to_pylist():
                i += 1
                stats.add_rows(1)
                conv = _validated(row, f"{path}:row {i}", stats)
                if conv is not None:
                    yield conv
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"cannot read data file {path} ({builder}): {type(e).__name__}: {e}") from e


def _iter_datasets_files(files: list, builder: str, label: str, stats: BadDataStats) -> Iterator[dict]:
    if builder in ("parquet", "arrow"):
        for path in files:
            yield from _iter_arrow_batches(path, builder, stats)
        return
    datasets = _datasets()
    for path in files:
        try:
            ds = datasets.load_dataset(builder, data_files=[path], split="train", streaming=True)
        except Exception as e:
            raise DataError(f"cannot read data file {path} ({builder}): {type(e).__name__}: {e}") from e
        yield from _iter_rows(ds, lambda i, p=path: f"{p}:row {i + 1}", stats)


def _is_saved_dataset(path: str) -> bool:
    names = set(os.listdir(path))
    return "dataset_dict.json" in names or ("state.json" in names and "dataset_info.json" in names)


def _iter_saved(path: str, stats: BadDataStats) -> Iterator[dict]:
    datasets = _datasets()
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:
        raise DataError(f"cannot load the saved dataset {path}: {type(e).__name__}: {e}") from e
    split = None
    if isinstance(ds, datasets.DatasetDict):
        if "train" in ds:
            split = "train"
        elif len(ds) == 1:
            split = next(iter(ds))
        else:
            raise DataError(f"{path} holds splits {sorted(ds)} and none is called train: save the one to train on")
        ds = ds[split]
    label = f"{path}[{split}]" if split else path
    yield from _iter_rows(ds, lambda i: f"{label}:row {i + 1}", stats)


def _kind(path: str) -> Optional[str]:
    low = path.lower()
    if low.endswith(JSONL_SUFFIXES):
        return "jsonl"
    for suf, builder in DATASETS_SUFFIXES.items():
        if low.endswith(suf):
            return builder
    return None


def iter_conversations(source: str, stats: BadDataStats) -> Iterator[dict]:
    """Valid conversations of ``source`` one at a time (each with ``source = "<location>"``, except builtin);
    bad rows counted in ``stats``. Raises DataError for a source that does not exist or cannot be read."""
    if source in PACKAGED_SOURCES:
        yield from builtin_conversations(source)
        return
    if not os.path.exists(source):
        raise DataError(f"data.source={source!r}: no such file or directory (builtin, a .jsonl/.json/.parquet/"
                        ".arrow file, or a datasets save_to_disk directory)")
    if os.path.isdir(source):
        if _is_saved_dataset(source):
            yield from _iter_saved(source, stats)
            return
        files = sorted(os.path.join(source, n) for n in os.listdir(source) if _kind(n))
        kinds = {_kind(f) for f in files}
        if not files:
            raise DataError(f"data.source={source!r}: a directory with no .jsonl/.json/.parquet/.arrow files and "
                            "no save_to_disk dataset in it")
        if len(kinds) > 1:
            raise DataError(f"data.source={source!r}: mixes file kinds {sorted(kinds)}; keep one kind per directory")
        kind = kinds.pop()
        if kind == "jsonl":
            for f in files:
                yield from _iter_jsonl(f, stats)
        else:
            yield from _iter_datasets_files(files, kind, source, stats)
        return
    kind = _kind(source)
    if kind == "jsonl" or kind is None:  # unknown suffix: JSONL, as before
        yield from _iter_jsonl(source, stats)
    else:
        yield from _iter_datasets_files([source], kind, source, stats)


def read_conversations(source: str, stats: BadDataStats) -> list[dict]:
    """:func:`iter_conversations` as a list."""
    return list(iter_conversations(source, stats))


# ----------------------------------------------------------------------------------------------- tokenizing

def tokenize_stream(conversations: Iterable[dict], tokenizer_path: str, max_length: int, overlong: str,
                    num_workers: int, stats: BadDataStats, vocab_size: Optional[int] = None,
                    chat_template_kwargs: Optional[dict] = None, window: int = 1024):
    """``build_tokenized_dataset`` over an iterator, with at most ``window`` conversations in flight.

    Same samples, same order, same stats as ``build_tokenized_dataset(list(conversations), ...)``; memory is
    the window plus the result (int32 tokens and mask bytes), not the corpus. ``conv_ids`` count the
    conversations of the stream."""
    from dflash_dist.data import tokenize as T
    if overlong not in T.OVERLONG_MODES:
        raise ValueError(f"overlong={overlong!r}: use truncate or skip")
    window = max(1, int(window))
    packed = T._Packed()
    pool = None
    tok = None
    try:
        if num_workers > 0:
            pool = ProcessPoolExecutor(num_workers, mp_context=mp.get_context("spawn"), initializer=T._worker_init,
                                       initargs=(tokenizer_path, max_length, overlong, vocab_size,
                                                 chat_template_kwargs))
        else:
            tok = T._load_tokenizer(tokenizer_path)
        it = iter(conversations)
        while True:
            chunk = []
            for c in it:
                chunk.append(c)
                if len(chunk) >= window:
                    break
            if not chunk:
                break
            stats.add_rows(T._uncounted_rows(chunk))
            if pool is not None:
                try:
                    results = list(pool.map(T._worker_run, chunk, chunksize=max(1, len(chunk) // (4 * num_workers))))
                except BrokenProcessPool as e:
                    raise DataError(f"a tokenization worker died ({e}); set data.num_workers=0 to see why") from e
            else:
                results = [T._pack(T._tokenize(tok, c, max_length, overlong, vocab_size, chat_template_kwargs))
                           for c in chunk]
            packed.add(chunk, results, stats, max_length)
            del chunk, results
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return packed.dataset(tokenizer_path, max_length, overlong, vocab_size, chat_template_kwargs)


# ----------------------------------------------------------------------------------------------- template options

def parse_template_kwargs(value: Optional[str]) -> Optional[dict]:
    """``--chat-template-kwargs`` of the CLIs: JSON (``'{"enable_thinking": false}'``), or a path to a run's
    ``config.json`` / a checkpoint's ``meta.json`` / an export's ``dflash_dist_meta.json`` whose recorded
    ``data.chat_template_kwargs`` (or ``chat_template_kwargs``) is taken. None/empty: None."""
    if not value:
        return None
    if os.path.exists(value):
        with open(value) as f:
            obj = json.load(f)
        if isinstance(obj.get("chat_template_kwargs"), dict):
            return dict(obj["chat_template_kwargs"])
        for d in (obj.get("data"), (obj.get("job_config") or {}).get("data")):
            if isinstance(d, dict) and isinstance(d.get("chat_template_kwargs"), dict):
                return dict(d["chat_template_kwargs"])
        return {}
    try:
        obj = json.loads(value)
    except ValueError as e:
        raise DataError(f"--chat-template-kwargs {value!r}: neither JSON nor a file ({e})") from e
    if not isinstance(obj, dict):
        raise DataError(f"--chat-template-kwargs {value!r}: must be a JSON object")
    return obj


# ----------------------------------------------------------------------------------------------- the job's data

def no_usable_data(source: str, stats: BadDataStats) -> DataError:
    """The one message of a source without a single usable conversation: the file, its rows and why."""
    what = "the packaged corpus" if source in PACKAGED_SOURCES else f"data.source={source}"
    return DataError(f"{what}: no usable conversation in {stats.total} row(s); fix the file or point data.source "
                     f"at another one\n{stats.summary()}")


def prepare_conversations(source: str, holdout: int, seed: int, tokenizer_path: str, max_length: int,
                          overlong: str, num_workers: int, stats: BadDataStats, vocab_size: Optional[int] = None,
                          chat_template_kwargs: Optional[dict] = None, window: int = 1024):
    """(TokenizedDataset of the training conversations, held-out conversations) of ``source``, streamed.

    Two passes over the source: the first counts its valid conversations (its bad rows are not counted), the
    split (``plan.split_holdout`` over that count) picks the held-out ones, the second tokenizes the others as a
    stream (:func:`tokenize_stream`) and keeps the few held-out ones. The same samples, ids, held-out set and
    stats as tokenizing the whole list; the memory is the tokenized result and a window, not the corpus."""
    from dflash_dist.data.batching import holdout_size, split_holdout
    counted = BadDataStats()
    n = sum(1 for _ in iter_conversations(source, counted))
    if n == 0:
        raise no_usable_data(source, counted)
    n_hold = holdout_size(n, holdout)  # at most 10%: a small file still trains
    log.info("data: %d conversations, %d held out for evaluation (data.holdout=%d, at most 10%% of the data)", n,
             n_hold, holdout)
    _, held_ids = split_holdout(n, n_hold, seed)
    held, held_convs = set(held_ids), []

    def training():
        for i, conv in enumerate(iter_conversations(source, stats)):
            if i in held:
                held_convs.append(conv)
            else:
                yield conv
    from dflash_dist.data.tokenize import ROWS_PER_WORKER, tokenize_workers
    workers = tokenize_workers(n - n_hold, num_workers)  # a small file tokenizes in-process: workers cost seconds
    if workers != num_workers:
        log.info("data: tokenizing %d conversations in %s (data.num_workers=%d pays off from %d rows per worker)",
                 n - n_hold, f"{workers} worker processes" if workers else "this process", num_workers,
                 ROWS_PER_WORKER)
    ds = tokenize_stream(training(), tokenizer_path, max_length, overlong, workers, stats, vocab_size,
                         chat_template_kwargs, window)
    return ds, held_convs
