"""Assistant-only loss masks for the chat-template shapes of the new target families, hand-written (no family
tokenizer offline) on the packaged tiny tokenizer with the family's markers added as special tokens: Llama 3.x
(header ids, <|eot_id|>), Mistral ([INST] ... [/INST] reply</s>), gpt-oss (harmony: <|start|>assistant
<|channel|>final<|message|> ... <|end|>, the last reply closed by <|return|>)."""

import pytest

from dflash_dist.data import template, tokenize
from dflash_dist.targets.hf import TINY_DIR

LLAMA3 = (
    "{{- bos_token }}{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{- m['content'] | trim }}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}")
MISTRAL = (
    "{{- bos_token }}{%- for m in messages %}{%- if m['role'] == 'user' %}[INST] {{ m['content'] }}[/INST]"
    "{%- elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{%- endif %}{%- endfor %}")
GPT_OSS = (
    "<|start|>system<|message|>You are ChatGPT.<|end|>"
    "{%- for m in messages %}{%- if m['role'] == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{- m['content'] }}{%- if loop.last and not add_generation_prompt %}<|return|>{%- else %}<|end|>{%- endif %}"
    "{%- else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")

MARKERS = {"llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
           "mistral": ["<s>", "</s>", "[INST]", "[/INST]"],
           "gpt_oss": ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>"]}


def _tok(family, template):
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(TINY_DIR)
    t.add_special_tokens({"additional_special_tokens": MARKERS[family]})
    if family == "llama3":
        t.bos_token = "<|begin_of_text|>"
    if family == "mistral":
        t.bos_token, t.eos_token = "<s>", "</s>"
    t.chat_template = template
    return t


def _runs(t, ids, mask):
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(t.decode(cur))
            cur = []
    if cur:
        runs.append(t.decode(cur))
    return runs


def _conv(*pairs):
    return {"messages": [{"role": r, "content": c} for r, c in pairs]}


TWO_TURNS = _conv(("user", "Hi there"), ("assistant", "Hello!"), ("user", "2+2?"), ("assistant", "4"))


@pytest.mark.parametrize("family,template,want", [
    ("llama3", LLAMA3, ["Hello!<|eot_id|>", "4<|eot_id|>"]),
    ("mistral", MISTRAL, ["Hello!</s>", "4</s>"]),
])
def test_family_masks(family, template, want):
    t = _tok(family, template)
    r = tokenize.tokenize_conversation(t, TWO_TURNS, 256, "truncate")
    assert not isinstance(r, str), r
    ids, mask = r
    assert _runs(t, ids, mask) == want
    assert len(ids) == len(mask) and not mask[0]


def test_gpt_oss_harmony_mask():
    """The harmony template closes earlier replies with <|end|> and the last with <|return|>: each reply is
    supervised up to its own closing marker, and nothing of the user turns or the system prompt."""
    t = _tok("gpt_oss", GPT_OSS)
    one = _conv(("user", "Hi there"), ("assistant", "Hello!"))
    ids, mask = tokenize.tokenize_conversation(t, one, 256, "truncate")
    assert _runs(t, ids, mask) == ["<|channel|>final<|message|>Hello!<|return|>"]
    r = tokenize.tokenize_conversation(t, TWO_TURNS, 256, "truncate")
    assert not isinstance(r, str), r
    assert _runs(t, *r) == ["<|channel|>final<|message|>Hello!<|end|>", "<|channel|>final<|message|>4<|return|>"]
    three = _conv(("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d"), ("user", "e"),
                  ("assistant", "f"))
    r = tokenize.tokenize_conversation(t, three, 256, "truncate")
    assert not isinstance(r, str), r
    assert [x.rsplit("<|message|>", 1)[1] for x in _runs(t, *r)] == ["b<|end|>", "d<|end|>", "f<|return|>"]
    assert template.template_info(t).closes == ("<|return|>", "<|end|>")


def test_one_marker_templates_have_one_close():
    """ChatML and Llama 3 close every reply alike: one marker, no second one guessed from the probe."""
    assert template.template_info(_tok("llama3", LLAMA3)).closes == ("<|eot_id|>",)
