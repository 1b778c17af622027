#!/usr/bin/env python
"""Build the packaged tiny tokenizer and target config in ``dflash_dist/assets/tiny``.

A byte-level BPE (HF ``tokenizers``) with 2048 entries in all (256 byte symbols, 4 specials, merges) is
trained on the English part of ``chatterbot-corpus`` rendered as ChatML, so the role names and line breaks
of the template get their own tokens. Everything is fixed (file order, hyper-parameters, no randomness),
so running the script again rewrites identical files; ``--check`` verifies that without writing.

Specials: ``<|endoftext|>`` (eos, pad, bos in the model config like Qwen3), ``<|im_start|>``,
``<|im_end|>`` and ``<|MASK|>`` (the DFlash mask token, ``tokenizer.mask_token``).

Usage: python scripts/build_tiny_tokenizer.py [--out dflash_dist/assets/tiny] [--check]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

VOCAB_SIZE = 2048
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
# ChatML. Written by hand; kept free of HF-only extensions so any jinja renderer can use it.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MODEL_CONFIG = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def chatml(messages: list[dict]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from dflash_dist.data.conversations import chatterbot_conversations

    texts = [chatml(c["messages"]) for c in chatterbot_conversations()]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"BPE ended with {tok.get_vocab_size()} entries, expected {VOCAB_SIZE}: "
                         "the corpus is too small for that many merges (lower min_frequency)")
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def write_assets(out: str) -> None:
    """Write tokenizer.json, tokenizer_config.json (template inline) and config.json.

    The tokenizer config is written by hand rather than by ``save_pretrained`` so that it loads as
    PreTrainedTokenizerFast under transformers 4.x and 5.x alike (5.x would write its own class name and
    a separate chat_template.jinja). config.json carries both rope keys (5.x ``rope_parameters``, 4.x
    ``rope_theta``).
    """
    from transformers import AutoConfig, AutoTokenizer, Qwen3Config

    os.makedirs(out, exist_ok=True)
    for stale in ("chat_template.jinja", "special_tokens_map.json"):
        if os.path.exists(os.path.join(out, stale)):
            os.remove(os.path.join(out, stale))
    tok = train_tokenizer()
    tok.save(os.path.join(out, "tokenizer.json"), pretty=True)
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "mask_token": "<|MASK|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    _write_json(os.path.join(out, "tokenizer_config.json"), tok_cfg)

    hf_tok = AutoTokenizer.from_pretrained(out)
    assert len(hf_tok) == VOCAB_SIZE and hf_tok.mask_token == "<|MASK|>", (len(hf_tok), hf_tok.mask_token)
    eot = hf_tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = Qwen3Config(vocab_size=len(hf_tok), bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
                      **MODEL_CONFIG)
    cfg.architectures = ["Qwen3ForCausalLM"]
    d = cfg.to_diff_dict()
    d.pop("transformers_version", None)  # keep the file identical across library versions
    d["dtype"] = "float32"
    d["rope_theta"] = MODEL_CONFIG["rope_theta"]
    _write_json(os.path.join(out, "config.json"), d)
    back = AutoConfig.from_pretrained(out)
    assert back.vocab_size == VOCAB_SIZE and back.model_type == "qwen3"


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(REPO, "dflash_dist", "assets", "tiny"))
    ap.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare with --out")
    args = ap.parse_args()
    if not args.check:
        write_assets(args.out)
        print(f"wrote {sorted(os.listdir(args.out))} to {args.out}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        write_assets(tmp)
        names = sorted(os.listdir(tmp))
        _, mismatch, errors = filecmp.cmpfiles(args.out, tmp, names, shallow=False)
        if mismatch or errors:
            raise SystemExit(f"assets differ from a fresh build: {mismatch + errors}")
        print(f"identical: {names}")


if __name__ == "__main__":
    main()
