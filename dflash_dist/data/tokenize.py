"""Conversations -> tokenized samples with an assistant-only loss mask -> a rank-independent batching plan.

Pipeline (all CPU, done once per run and cached by the caller):

1. ``builtin_conversations()`` or ``read_jsonl_conversations(path, stats)`` give a list of
   ``{"messages": [{"role", "content"}, ...]}`` dicts. The reader validates every row; a bad row is counted
   per reason in ``BadDataStats`` with its ``file:line`` and left out, never raised, never dropped silently.
2. ``build_tokenized_dataset(...)`` renders each conversation with the tokenizer's chat template and builds
   the loss mask (see ``tokenize_conversation``); unusable samples are counted in the same stats. Work runs
   in a spawn process pool (never threads) when the rows are many enough to repay the workers' start-up
   (``tokenize_workers``: at most ``num_workers``), with the same result as in-process.
3. ``TokenizedDataset`` keeps everything in three flat tensors (int32 tokens, bool mask, int64 offsets);
   sample ids are its row indices ``0..N-1``. ``save`` is atomic.
4. ``build_plan(lengths, sample_ids, ...)`` turns (lengths, seed, epochs, batch budget) into the batches of
   every epoch. It knows nothing about ranks, so a resumed run with another target/drafter split replays
   the same sample order.

Loss-mask convention: ``loss_mask[t]`` is True when token ``t`` belongs to an assistant reply (its content
and the closing end-of-turn token such as ``<|im_end|>``), i.e. a token the drafter must learn to predict.
System and user turns, the ``<|im_start|>assistant\\n`` header and the newline after ``<|im_end|>`` are False.
"""

from __future__ import annotations

import array
import hashlib
import json
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from dflash_dist.data.conversations import (
    CHAT_TEMPLATE_ERROR,
    NO_SUPERVISED_TOKENS,
    SPECIAL_TOKEN_IN_CONTENT,
    TOKEN_OUT_OF_VOCAB,
    TOKENIZER_ERROR,
    TOO_LONG,
    TRUNCATED,
    TRUNCATED_NO_SUPERVISED,
    BadDataStats,
    DataError,
    validate_conversation,
)
from dflash_dist.data.template import assistant_char_spans, render_chat, template_info

OVERLONG_MODES = ("truncate", "skip")


# the cache file's format and tokenization rules: bump it when either changes (2: templates that close earlier
# replies with another marker, gpt-oss's <|end|>, are masked instead of refused)
FORMAT = "dflash_dist.tokenized/2"




@dataclass
class Sample:
    sample_id: int
    input_ids: Union[list, Tensor]
    loss_mask: Union[list, Tensor]


def _tokenize(tokenizer, conv: dict, max_length: int, overlong: str, vocab_size: Optional[int],
              template_kwargs: Optional[dict] = None):
    """``(ids, mask, truncated)`` or ``(reason, detail)``."""
    if overlong not in OVERLONG_MODES:
        raise ValueError(f"overlong={overlong!r}: use truncate or skip")
    norm, reason, detail = validate_conversation(conv)
    if norm is None:
        return reason, detail
    messages = norm["messages"]
    info = template_info(tokenizer, template_kwargs)
    for j, m in enumerate(messages):
        for s in info.specials:
            if s in m["content"]:
                return SPECIAL_TOKEN_IN_CONTENT, f"messages[{j}] contains {s!r}"
    try:
        full = render_chat(tokenizer, messages, False, template_kwargs)
        spans = assistant_char_spans(tokenizer, messages, full, info.closes, template_kwargs)
    except Exception as e:  # a template that raises on this conversation (e.g. role order it refuses)
        return CHAT_TEMPLATE_ERROR, f"{type(e).__name__}: {e}"
    if isinstance(spans, tuple):
        return spans
    try:
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    except Exception as e:  # last line of defence: one odd row must not stop the run
        return TOKENIZER_ERROR, f"{type(e).__name__}: {e}"
    ids = list(enc["input_ids"])
    offsets = enc["offset_mapping"]
    mask = [False] * len(ids)
    si = 0
    for t, (a, _b) in enumerate(offsets):
        while si < len(spans) and a >= spans[si][1]:
            si += 1
        if si == len(spans):
            break
        mask[t] = spans[si][0] <= a < spans[si][1]
    if vocab_size is not None and ids and max(ids) >= vocab_size:
        bad = max(ids)
        return TOKEN_OUT_OF_VOCAB, f"token id {bad} ({tokenizer.convert_ids_to_tokens(bad)!r}) >= vocab {vocab_size}"
    if not any(mask):
        return NO_SUPERVISED_TOKENS, ""
    truncated = False
    if len(ids) > max_length:
        if overlong == "skip":
            return TOO_LONG, f"{len(ids)} tokens > max_length {max_length}"
        ids, mask, truncated = ids[:max_length], mask[:max_length], True
        if not any(mask):
            return TRUNCATED_NO_SUPERVISED, f"no assistant token in the first {max_length} tokens"
    return ids, mask, truncated


def tokenize_conversation(tokenizer, conv: dict, max_length: int, overlong: str, vocab_size: Optional[int] = None,
                          chat_template_kwargs: Optional[dict] = None) -> Union[tuple[list, list], str]:
    """``(input_ids, loss_mask)`` of one conversation, or the reason string when it is unusable.

    ``vocab_size``: the target model's vocabulary size; a token id at or above it makes the sample unusable
    (``token_out_of_vocab``). ``overlong``: ``truncate`` keeps the first ``max_length`` tokens (it must keep a
    supervised token), ``skip`` rejects the sample (``too_long``). Use ``build_tokenized_dataset`` to also
    count truncations. ``chat_template_kwargs`` go to ``apply_chat_template`` (e.g. ``enable_thinking``).
    """
    r = _tokenize(tokenizer, conv, max_length, overlong, vocab_size, chat_template_kwargs)
    if len(r) == 2:
        return r[0]
    return r[0], r[1]


class TokenizedDataset:
    """Samples in three flat tensors: ``tokens`` int32 [T], ``loss_mask`` bool [T], ``offsets`` int64 [N+1].

    ``conv_ids`` int64 [N]: index of each sample in the conversation list it was built from.
    ``meta``: a small JSON-able dict (tokenizer, max_length, ...). Sample ids are row indices 0..N-1.
    """

    def __init__(self, tokens: Tensor, loss_mask: Tensor, offsets: Tensor,
                 conv_ids: Optional[Tensor] = None, meta: Optional[dict] = None):
        self.tokens = tokens.to(torch.int32).contiguous()
        self.loss_mask = loss_mask.to(torch.bool).contiguous()
        self.offsets = offsets.to(torch.int64).contiguous()
        n = self.offsets.numel() - 1
        self.conv_ids = (torch.arange(n, dtype=torch.int64) if conv_ids is None
                         else conv_ids.to(torch.int64).contiguous())
        self.meta = dict(meta or {})
        if (n < 0 or self.tokens.numel() != self.loss_mask.numel() or self.conv_ids.numel() != n
                or (n >= 0 and int(self.offsets[0]) != 0) or int(self.offsets[-1]) != self.tokens.numel()
                or bool((self.offsets[1:] < self.offsets[:-1]).any())):
            raise DataError("inconsistent TokenizedDataset tensors (corrupt cache?)")
        self.lengths = self.offsets[1:] - self.offsets[:-1]

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def __getitem__(self, i: int) -> Sample:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples")
        i = i % n
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return Sample(i, self.tokens[a:b].long(), self.loss_mask[a:b].clone())

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    def save(self, path: str) -> None:
        """Write atomically: temp file in the same directory, fsync, rename, fsync the directory."""
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        payload = {"format": FORMAT, "tokens": self.tokens, "loss_mask": self.loss_mask,
                   "offsets": self.offsets, "conv_ids": self.conv_ids, "meta": self.meta}
        try:
            with open(tmp, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        try:
            fd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass

    @staticmethod
    def load(path: str) -> "TokenizedDataset":
        try:
            p = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise DataError(f"cannot load tokenized dataset {path}: {type(e).__name__}: {e}") from e
        if not isinstance(p, dict) or p.get("format") != FORMAT:
            raise DataError(f"{path} is not a {FORMAT} file")
        return TokenizedDataset(p["tokens"], p["loss_mask"], p["offsets"], p.get("conv_ids"), p.get("meta"))


_WORKER_TOK = None


_WORKER_ARGS: tuple = ()


def _load_tokenizer(tokenizer_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path)


def _worker_init(tokenizer_path: str, max_length: int, overlong: str, vocab_size: Optional[int],
                 template_kwargs: Optional[dict]) -> None:
    global _WORKER_TOK, _WORKER_ARGS
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.set_num_threads(1)
    _WORKER_TOK = _load_tokenizer(tokenizer_path)
    _WORKER_ARGS = (max_length, overlong, vocab_size, template_kwargs)


def _pack(r):
    if len(r) == 2:
        return r
    ids, mask, truncated = r
    return array.array("i", ids).tobytes(), bytes(mask), truncated


def _worker_run(conv: dict):
    return _pack(_tokenize(_WORKER_TOK, conv, *_WORKER_ARGS))


# Rows per tokenizing worker before a pool pays for itself: 2 workers halve the time per row but cost seconds of
# start-up (spawned interpreters importing transformers, loading the tokenizer), so on a 2-core machine 2 workers
# win from ~32k rows of the packaged tiny corpus, and 4 workers never (measured with
# bench/experiments/tokenize_workers.py: docs/benchmarks.md#tokenize-workers). Longer conversations than the tiny corpus' cross over earlier.
ROWS_PER_WORKER = 16384


def tokenize_workers(num_rows: int, num_workers: int) -> int:
    """Worker processes to tokenize ``num_rows`` rows with: at most ``num_workers`` (``data.num_workers``) and the
    CPUs this process may use, one per ``ROWS_PER_WORKER`` rows; 0 (in-process) below that, where starting
    workers costs more than they save; never a single worker (it only adds its start-up)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = min(int(num_workers), cpus, int(num_rows) // ROWS_PER_WORKER)
    return n if n >= 2 else 0


def build_tokenized_dataset(conversations: Sequence[dict], tokenizer_path: str, max_length: int, overlong: str,
                            num_workers: int, stats: BadDataStats, vocab_size: Optional[int] = None,
                            chat_template_kwargs: Optional[dict] = None, chunksize: int = 64,
                            force_workers: bool = False) -> TokenizedDataset:
    """Tokenize ``conversations`` (row order kept) into a TokenizedDataset; unusable ones go to ``stats``.

    Conversations that carry ``source`` (from ``read_jsonl_conversations``) were already counted as rows;
    the others (builtin, in-memory) are counted here. ``num_workers > 0`` allows a spawn process pool of up to
    that many workers (:func:`tokenize_workers` picks how many from the row count; ``force_workers`` uses exactly
    ``num_workers``), each loading the tokenizer from ``tokenizer_path``. ``vocab_size`` is the target model's
    vocabulary size (ids at or above it are bad rows). Call ``stats.check(max_bad_fraction)`` afterwards.
    """
    if overlong not in OVERLONG_MODES:
        raise ValueError(f"overlong={overlong!r}: use truncate or skip")
    convs = list(conversations)
    stats.add_rows(_uncounted_rows(convs))
    if not force_workers:
        num_workers = tokenize_workers(len(convs), num_workers)
    if num_workers > 0 and len(convs) > 0:
        # spawn, not fork: the caller may already run threads (torch, NCCL, CUDA). A process pool, not
        # multiprocessing.Pool: a worker that dies raises BrokenProcessPool instead of being respawned forever.
        try:
            with ProcessPoolExecutor(num_workers, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                                     initargs=(tokenizer_path, max_length, overlong, vocab_size,
                                               chat_template_kwargs)) as pool:
                results = list(pool.map(_worker_run, convs, chunksize=max(1, chunksize)))
        except BrokenProcessPool as e:
            raise DataError(f"a tokenization worker died ({e}); the main module must be importable by spawned "
                            "processes (run from a file, not stdin), or set data.num_workers=0") from e
    else:
        tok = _load_tokenizer(tokenizer_path)
        results = [_pack(_tokenize(tok, c, max_length, overlong, vocab_size, chat_template_kwargs)) for c in convs]

    packed = _Packed()
    packed.add(convs, results, stats, max_length)
    return packed.dataset(tokenizer_path, max_length, overlong, vocab_size, chat_template_kwargs)


def _source(conv) -> Optional[str]:
    """The ``file:line`` a reader recorded for a conversation (None: builtin or in-memory)."""
    src = conv.get("source") if isinstance(conv, dict) else None
    return src if isinstance(src, str) else None


def _uncounted_rows(convs: Sequence) -> int:
    """How many of ``convs`` no reader counted as a row yet (those without a ``source``)."""
    return sum(1 for c in convs if _source(c) is None)


class _Packed:
    """The usable tokenizations of consecutive conversations, appended as packed int32 tokens and mask bytes
    (``_pack``'s form), so a stream holds the result and not the corpus."""

    def __init__(self):
        self.tokens, self.mask = array.array("i"), bytearray()
        self.lengths: list[int] = []
        self.conv_ids: list[int] = []
        self.num_conversations = 0

    def add(self, convs: Sequence, results: Sequence, stats: BadDataStats, max_length: int) -> None:
        """The next ``convs`` and their ``_pack`` results; refused ones go to ``stats``."""
        for j, (c, r) in enumerate(zip(convs, results)):
            i = self.num_conversations + j
            where = _source(c)
            where = f"conversation[{i}]" if where is None else where
            if len(r) == 2:
                stats.bad(r[0], where, r[1])
                continue
            ids_b, mask_b, truncated = r
            if truncated:
                stats.note(TRUNCATED, where, f"cut to {max_length} tokens")
            self.tokens.frombytes(ids_b)
            self.mask += mask_b
            self.lengths.append(len(mask_b))
            self.conv_ids.append(i)
        self.num_conversations += len(convs)

    def dataset(self, tokenizer_path: str, max_length: int, overlong: str, vocab_size: Optional[int],
                chat_template_kwargs: Optional[dict]) -> TokenizedDataset:
        """What was added, as a TokenizedDataset whose meta records the tokenization settings."""
        tokens = torch.frombuffer(bytearray(self.tokens.tobytes()), dtype=torch.int32) if len(self.tokens) else \
            torch.zeros(0, dtype=torch.int32)
        mask = torch.frombuffer(self.mask, dtype=torch.uint8).bool() if len(self.mask) else \
            torch.zeros(0, dtype=torch.bool)
        offsets = torch.zeros(len(self.lengths) + 1, dtype=torch.int64)
        if self.lengths:
            offsets[1:] = torch.cumsum(torch.tensor(self.lengths, dtype=torch.int64), 0)
        meta = {"tokenizer": str(tokenizer_path), "max_length": int(max_length), "overlong": overlong,
                "vocab_size": None if vocab_size is None else int(vocab_size),
                "num_conversations": self.num_conversations, "chat_template_kwargs": dict(chat_template_kwargs or {})}
        return TokenizedDataset(tokens, mask, offsets, torch.tensor(self.conv_ids, dtype=torch.int64), meta)


def cache_key(data_hash: str, tokenizer_hash: str) -> str:
    """The name of a tokenized cache: the content hashes of the data (with the settings that change its samples)
    and of the tokenizer's files (``checkpoint.identity.data_identity``), and this file format, which changes
    with the tokenization rules, so a cache built by other rules is never read."""
    return hashlib.sha256(json.dumps([FORMAT, data_hash, tokenizer_hash]).encode()).hexdigest()[:16]
