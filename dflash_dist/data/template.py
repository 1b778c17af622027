"""What a tokenizer's chat template writes around assistant replies, found by rendering probe conversations.

The loss mask covers exactly the tokens the target generates in a reply, so tokenization must know where each
assistant turn starts and ends in the rendered text. Templates differ (ChatML's ``<|im_end|>``, Llama 3's
``<|eot_id|>``, gpt-oss closing earlier replies with ``<|end|>`` and the last with ``<|return|>``, Qwen3's empty
``<think>`` block), so nothing is hard-coded: ``template_info`` renders probe replies once per tokenizer, template
and kwargs and caches the closing markers and the tokenizer's special-token strings (refused inside message
content), and ``assistant_char_spans`` locates each reply of a real conversation from prefix renderings and those
markers, or says why the template does not behave that way.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional, Union

from dflash_dist.data.conversations import CHAT_TEMPLATE_MISMATCH

_TEMPLATE_INFO: dict = {}


_PROBE = "Zq7xDFLASHPROBEx7qZ"


def render_chat(tokenizer, messages: list, add_generation_prompt: bool,
                template_kwargs: Optional[dict] = None) -> str:
    """``messages`` rendered as text by the tokenizer's chat template (a TypeError if it returns anything else)."""
    out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                        **(template_kwargs or {}))
    if not isinstance(out, str):
        raise TypeError(f"apply_chat_template returned {type(out).__name__}, expected str")
    return out


class TemplateInfo(NamedTuple):
    close: str
    """What the template writes right after the content of the last reply (``<|im_end|>`` for ChatML)."""
    specials: tuple
    """The tokenizer's special-token strings (refused inside message content)."""
    closes: tuple
    """Every marker that can close a reply: ``close`` and, where the template closes earlier replies
    differently (gpt-oss: ``<|end|>`` before, ``<|return|>`` last), that marker too."""


def _probe_close(after: str, specials: tuple) -> str:
    """The closing marker at the start of ``after`` (the text right after a probe reply): the longest special
    token it starts with, or "" when none does."""
    head = after.lstrip()
    for s in sorted(specials, key=len, reverse=True):
        if head.startswith(s):
            return s
    return ""


def template_info(tokenizer, template_kwargs: Optional[dict] = None) -> TemplateInfo:
    """The closing markers of assistant turns and the special-token strings of this tokenizer, cached.

    The marker of the last reply is what the template writes right after the reply content, without trailing
    whitespace, found by rendering a probe reply. The marker of an earlier reply is the special token right
    after the first of two probe replies (templates may close history turns differently). Empty if not found.
    """
    key = (id(tokenizer), str(getattr(tokenizer, "chat_template", None)), repr(sorted((template_kwargs or {}).items())))
    info = _TEMPLATE_INFO.get(key)
    if info is None:
        specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
        for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
            if getattr(tok, "special", False):
                specials.add(str(tok.content if hasattr(tok, "content") else tok))
        specials = tuple(sorted(s for s in specials if s))
        close, closes = "", ()
        try:
            user = [{"role": "user", "content": "hi"}]
            p = render_chat(tokenizer, user, True, template_kwargs)
            f = render_chat(tokenizer, user + [{"role": "assistant", "content": _PROBE}], False, template_kwargs)
            k = f.find(_PROBE, len(p) if f.startswith(p) else 0)
            if k >= 0:
                close = f[k + len(_PROBE):].rstrip()
            closes = (close,) if close else ()
            two = user + [{"role": "assistant", "content": _PROBE + "1"}, {"role": "user", "content": "again"},
                          {"role": "assistant", "content": _PROBE + "2"}]
            f2 = render_chat(tokenizer, two, False, template_kwargs)
            k = f2.find(_PROBE + "1")
            after = f2[k + len(_PROBE) + 1:] if k >= 0 else ""
            if close and not after.lstrip().startswith(close):
                mid = _probe_close(after, specials)
                if mid:
                    closes = (close, mid)
        except Exception:
            pass
        info = TemplateInfo(close, specials, closes)
        _TEMPLATE_INFO[key] = info
    return info


def assistant_char_spans(tokenizer, messages: list, full: str, closes: tuple,
                          template_kwargs: Optional[dict] = None) -> Union[list, tuple]:
    """Character spans ``[start, end)`` of the supervised part of each assistant turn in ``full``.

    Start: the conversation before the turn rendered with the generation prompt must be a prefix of ``full``;
    the reply starts where it ends (so anything the template emits after the header, e.g. Qwen3's empty
    ``<think>`` block on the final turn, counts as reply: the target generates it). End: the first of the
    closing markers after the reply content, included; or, without a marker, the end of the turn rendered alone.
    Returns (reason, detail) when the template does not behave like that.
    """
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            # An opening reply: HF cannot render an empty conversation, so take what a lone probe reply and
            # the whole conversation have in common in front of the probe (the header).
            alone = render_chat(tokenizer, [{"role": "assistant", "content": _PROBE}], False, template_kwargs)
            k = alone.find(_PROBE)
            prefix = os.path.commonprefix([alone[:k], full]) if k >= 0 else ""
            user = [{"role": "user", "content": _PROBE}]
            u = render_chat(tokenizer, user, False, template_kwargs)
            g = render_chat(tokenizer, user, True, template_kwargs)
            header = g[len(u):] if g.startswith(u) else ""
            if header and header in prefix:  # stop after the generation-prompt header, as for later replies
                prefix = prefix[: prefix.find(header) + len(header)]
            if not prefix:
                return CHAT_TEMPLATE_MISMATCH, "cannot find the header of an opening assistant turn"
        else:
            prefix = render_chat(tokenizer, messages[:i], True, template_kwargs)
        if not full.startswith(prefix):
            return CHAT_TEMPLATE_MISMATCH, f"rendering before assistant turn {i} is not a prefix of the whole"
        start = len(prefix)
        if closes:
            body = m["content"].strip()
            k = full.find(body, start)
            search_from = k + len(body) if k >= 0 else start
            found = [(e, c) for c in closes if (e := full.find(c, search_from)) >= 0]
            if not found:
                return CHAT_TEMPLATE_MISMATCH, f"no {' or '.join(map(repr, closes))} after assistant turn {i}"
            e, c = min(found)
            end = e + len(c)
        else:
            upto = render_chat(tokenizer, messages[: i + 1], False, template_kwargs)
            if not full.startswith(upto):
                return CHAT_TEMPLATE_MISMATCH, f"assistant turn {i} does not render as a prefix"
            end = len(upto.rstrip())
        if (spans and start < spans[-1][1]) or end <= start:
            return CHAT_TEMPLATE_MISMATCH, f"assistant turn {i} span [{start}, {end}) is empty or overlaps"
        spans.append((start, end))
    return spans
