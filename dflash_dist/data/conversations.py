"""Conversations: reading and validating messages rows, the built-in corpus, bad-row accounting."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from dflash_dist.paths import TINY_DIR as ASSETS_TINY

REGENERATED_JSONL = os.path.join(ASSETS_TINY, "regenerated.jsonl")


ALLOWED_ROLES = ("system", "user", "assistant")


# Reasons a row is not used (each counted in BadDataStats.counts).
INVALID_UTF8 = "invalid_utf8"
MALFORMED_JSON = "malformed_json"


NOT_AN_OBJECT = "not_an_object"


MISSING_MESSAGES = "missing_messages"


MESSAGES_NOT_A_LIST = "messages_not_a_list"


EMPTY_MESSAGES = "empty_messages"


MESSAGE_NOT_AN_OBJECT = "message_not_an_object"


MISSING_ROLE = "missing_role"


UNKNOWN_ROLE = "unknown_role"


MISSING_CONTENT = "missing_content"


NON_STRING_CONTENT = "non_string_content"


EMPTY_CONTENT = "empty_content"


INVALID_UNICODE = "invalid_unicode"


NO_ASSISTANT_TURN = "no_assistant_turn"


SPECIAL_TOKEN_IN_CONTENT = "special_token_in_content"


CHAT_TEMPLATE_ERROR = "chat_template_error"


CHAT_TEMPLATE_MISMATCH = "chat_template_mismatch"


TOKENIZER_ERROR = "tokenizer_error"


TOO_LONG = "too_long"


TRUNCATED_NO_SUPERVISED = "truncated_no_supervised_tokens"


NO_SUPERVISED_TOKENS = "no_supervised_tokens"


TOKEN_OUT_OF_VOCAB = "token_out_of_vocab"


# Rows kept but changed (BadDataStats.notes; not bad).
TRUNCATED = "truncated"


class DataError(RuntimeError):
    """The data cannot be used as configured (too many bad rows, unreadable file, corrupt cache)."""


@dataclass
class BadDataStats:
    """Rows seen, bad rows per reason (with the first few ``file:line`` examples) and kept-but-changed rows.

    ``total`` counts rows (JSONL lines or in-memory conversations); ``good = total - bad``.
    ``notes`` counts rows that were kept but altered (``truncated``); they are not bad.
    """

    total: int = 0
    counts: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)
    examples: dict = field(default_factory=dict)
    max_examples: int = 3

    def add_rows(self, n: int = 1) -> None:
        self.total += int(n)

    def _example(self, reason: str, where: str, detail: str) -> None:
        ex = self.examples.setdefault(reason, [])
        if len(ex) < self.max_examples:
            detail = detail if len(detail) <= 160 else detail[:157] + "..."
            ex.append(f"{where}: {detail}" if detail else where)

    def bad(self, reason: str, where: str, detail: str = "") -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self._example(reason, where, detail)

    def note(self, reason: str, where: str, detail: str = "") -> None:
        self.notes[reason] = self.notes.get(reason, 0) + 1
        self._example(reason, where, detail)

    @property
    def bad_rows(self) -> int:
        return sum(self.counts.values())

    @property
    def good_rows(self) -> int:
        return self.total - self.bad_rows

    @property
    def bad_fraction(self) -> float:
        return self.bad_rows / self.total if self.total else 0.0

    def summary(self) -> str:
        lines = [f"data: {self.total} rows, {self.good_rows} usable, {self.bad_rows} bad "
                 f"({100.0 * self.bad_fraction:.2f}%)"]
        for title, d in (("bad", self.counts), ("kept", self.notes)):
            for reason in sorted(d):
                lines.append(f"  {title} {reason}: {d[reason]}")
                lines.extend(f"      e.g. {e}" for e in self.examples.get(reason, []))
        return "\n".join(lines)

    def check(self, max_bad_fraction: float) -> None:
        check_bad_fraction(self.bad_fraction, max_bad_fraction, self.summary())
        if self.total > 0 and self.good_rows == 0:
            raise DataError("no usable data rows\n" + self.summary())


def check_bad_fraction(fraction: float, max_bad_fraction: float, summary: str) -> None:
    if fraction > max_bad_fraction:
        raise DataError(f"{100.0 * fraction:.2f}% of the data rows are unusable, more than "
                        f"data.max_bad_fraction={max_bad_fraction}. Fix the data or raise the limit.\n" + summary)


def validate_conversation(obj: Any) -> tuple[Optional[dict], Optional[str], str]:
    """``(normalized conversation, None, "")`` or ``(None, reason, detail)``.

    The normalized form keeps only ``role`` and ``content`` of each message; trailing non-assistant messages
    are dropped (they carry no loss). ``source`` is kept when present.
    """
    if not isinstance(obj, dict):
        return None, NOT_AN_OBJECT, f"row is a {type(obj).__name__}"
    if "messages" not in obj:
        return None, MISSING_MESSAGES, f"keys: {sorted(map(str, obj))[:8]}"
    msgs = obj["messages"]
    if not isinstance(msgs, list):
        return None, MESSAGES_NOT_A_LIST, f"messages is a {type(msgs).__name__}"
    if not msgs:
        return None, EMPTY_MESSAGES, ""
    out = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict):
            return None, MESSAGE_NOT_AN_OBJECT, f"messages[{j}] is a {type(m).__name__}"
        if "role" not in m:
            return None, MISSING_ROLE, f"messages[{j}]"
        role = m["role"]
        if not isinstance(role, str) or role not in ALLOWED_ROLES:
            return None, UNKNOWN_ROLE, f"messages[{j}].role={role!r:.40}"
        if "content" not in m:
            return None, MISSING_CONTENT, f"messages[{j}]"
        content = m["content"]
        if not isinstance(content, str):
            return None, NON_STRING_CONTENT, f"messages[{j}].content is a {type(content).__name__}"
        if not content.strip():
            return None, EMPTY_CONTENT, f"messages[{j}] ({role})"
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates from JSON escapes such as "\ud800"
            return None, INVALID_UNICODE, f"messages[{j}]: {e.reason} at {e.start}"
        out.append({"role": role, "content": content})
    while out and out[-1]["role"] != "assistant":
        out.pop()
    if not out:
        return None, NO_ASSISTANT_TURN, f"roles: {[m['role'] for m in msgs][:8]}"
    conv = {"messages": out}
    if isinstance(obj.get("source"), str):
        conv["source"] = obj["source"]
    return conv, None, ""


def read_jsonl_conversations(path: str, stats: BadDataStats) -> list[dict]:
    """Valid conversations of a JSONL file, each with ``source = "path:line"``; bad rows go to ``stats``.

    Every non-blank line is a row (``stats.total``); blank lines are not rows. Only an unreadable file raises
    (DataError); bad rows never do. Call ``stats.check(max_bad_fraction)`` once all data is tokenized.
    """
    out: list[dict] = []
    for where, obj in iter_jsonl_objects(path, stats):
        conv, reason, detail = validate_conversation(obj)
        if conv is None:
            stats.bad(reason, where, detail)
            continue
        conv["source"] = where
        out.append(conv)
    return out


def iter_jsonl_objects(path: str, stats: BadDataStats) -> Iterator[tuple[str, Any]]:
    """``("file:line", parsed JSON)`` of each non-empty line, one at a time (bounded memory); a line that is not
    UTF-8 or not JSON is counted as a bad row with its location and skipped."""
    try:
        f = open(path, "rb")  # binary: lines end at b"\n" only, undecodable bytes stay one row's problem
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e}") from e
    with f:
        for lineno, line in enumerate(f, start=1):
            if lineno == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            stats.add_rows(1)
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                stats.bad(INVALID_UTF8, where, str(e))
                continue
            try:
                yield where, json.loads(text)
            except (ValueError, RecursionError) as e:  # JSONDecodeError, int-digit limit, absurd nesting
                stats.bad(MALFORMED_JSON, where, f"{type(e).__name__}: {e}")


def chatterbot_conversations() -> list[dict]:
    """The English chatterbot-corpus dialogues as user/assistant conversations (files in name order)."""
    import yaml

    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the builtin corpus needs the chatterbot-corpus package: pip install 'dflash_dist[corpus]'")
    root = os.path.join(list(spec.submodule_search_locations)[0], "data", "english")
    convs = []
    for name in sorted(os.listdir(root)):
        if not name.endswith((".yml", ".yaml")):
            continue
        with open(os.path.join(root, name), encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
        for turns in doc.get("conversations") or []:
            if not isinstance(turns, list):
                continue
            texts = [str(t).strip() for t in turns if t is not None]
            msgs = [{"role": "user" if k % 2 == 0 else "assistant", "content": t} for k, t in enumerate(texts)]
            if len(msgs) % 2:
                msgs.pop()
            if msgs and all(m["content"] for m in msgs):
                convs.append({"messages": msgs})
    return convs


PACKAGED_SOURCES = ("builtin", "builtin_original")
"""The ``data.source`` values of the packaged corpus: regenerated by the tiny target, or its original responses."""


def builtin_conversations(source: str = "builtin") -> list[dict]:
    """Conversations of ``data.source=builtin``, or of ``builtin_original`` (the chatterbot dialogues as written,
    not regenerated: what ``drafter.loss.labels=target`` trains on without regenerating).

    ``assets/tiny/regenerated.jsonl`` (responses regenerated by the tiny target) when it exists, read
    strictly (any bad row raises DataError: it is a packaged file); else the chatterbot English dialogues.
    """
    if source == "builtin_original":
        return chatterbot_conversations()
    if os.path.exists(REGENERATED_JSONL):
        stats = BadDataStats()
        convs = read_jsonl_conversations(REGENERATED_JSONL, stats)
        if stats.bad_rows:
            raise DataError("packaged regenerated.jsonl has bad rows\n" + stats.summary())
        return [{"messages": c["messages"]} for c in convs]
    return chatterbot_conversations()
