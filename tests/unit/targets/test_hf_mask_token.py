"""MASK's token id for a target whose tokenizer has no mask token and whose vocabulary has no spare embedding row
(SmolLM2): a special token the training data never holds, the same on every rank; drafter.mask_token_id wins."""

import json
import logging
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dflash_dist.config import ConfigError
from dflash_dist.targets.hf import TINY_DIR, resolve_mask_token_id, unused_special_token

CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + ' ' + m['content'] + '<|im_end|>' + ' '}}"
          "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant '}}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<tool_call>", "<empty_output>"]


def chatml_tokenizer(template: str = CHATML, specials=SPECIALS) -> PreTrainedTokenizerFast:
    """A word-level ChatML tokenizer, special tokens first, ``<|endoftext|>`` the unknown token (as SmolLM2's), no
    mask token."""
    words = ["s", "u", "v", "a", "user", "assistant", "system", "hello"]
    vocab = {t: i for i, t in enumerate(list(specials) + words)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<|endoftext|>", eos_token="<|im_end|>",
                                  bos_token="<|im_start|>", pad_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": list(specials)})
    tok.chat_template = template
    return tok


def job(mask_token_id=None):
    """The two settings resolve_mask_token_id reads of a job config."""
    return SimpleNamespace(drafter=SimpleNamespace(mask_token_id=mask_token_id),
                           data=SimpleNamespace(chat_template_kwargs={}))


def test_a_full_vocabulary_without_mask_gets_the_highest_unused_special_token(caplog):
    tok = chatml_tokenizer()
    assert tok.mask_token_id is None and len(tok) == len(SPECIALS) + 8
    with caplog.at_level(logging.INFO, logger="dflash_dist.targets.hf"):
        mid = resolve_mask_token_id(job(), tok, len(tok))
    assert mid == SPECIALS.index("<empty_output>")
    assert "<empty_output>" in caplog.text and "chat template does not use" in caplog.text
    # the training rows' tokens never hold it: the template's probe and ordinary text tokenize around it
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "a"}],
                                   tokenize=False)
    assert mid not in tok(text, add_special_tokens=False)["input_ids"]


def test_tokens_the_template_writes_or_names_or_roles_hold_are_never_chosen():
    # a template that names <empty_output> (a tool turn, say) leaves the next one down
    tok = chatml_tokenizer(CHATML + "{% if tools %}<empty_output>{% endif %}")
    assert unused_special_token(tok) == SPECIALS.index("<tool_call>")
    # a template that writes every special token but one: that one
    tok = chatml_tokenizer(CHATML.replace("'<|im_start|>' +", "'<|im_start|> <tool_call> <empty_output> ' +"))
    assert unused_special_token(tok) == SPECIALS.index("<repo_name>")
    # only role tokens and template tokens: nothing to choose, and the job says how to set one
    tok = chatml_tokenizer(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert unused_special_token(tok) is None
    with pytest.raises(ConfigError, match="set drafter.mask_token_id"):
        resolve_mask_token_id(job(), tok, len(tok))


def test_override_mask_token_and_spare_row_come_first():
    tok = chatml_tokenizer()
    assert resolve_mask_token_id(job(mask_token_id=7), tok, len(tok)) == 7
    assert resolve_mask_token_id(job(), tok, len(tok) + 64) == len(tok)        # a spare row (Qwen3)
    tiny = AutoTokenizer.from_pretrained(TINY_DIR)
    assert resolve_mask_token_id(job(), tiny, len(tiny)) == tiny.convert_tokens_to_ids("<|MASK|>")


def test_the_choice_depends_on_the_tokenizer_alone(tmp_path):
    """Saved and reloaded (what every rank does), the tokenizer gives the same id."""
    tok = chatml_tokenizer()
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()).get("mask_token") is None
    assert resolve_mask_token_id(job(), again, len(again)) == resolve_mask_token_id(job(), tok, len(tok))
