"""What an acceptance evaluation needs besides the decoding itself: the held-out prompts (each conversation's
messages before its first assistant turn, chat template + generation prompt, the run's template kwargs), EOS ids,
and the drafter, its embedding / lm_head and the target rebuilt from a checkpoint or an export. Used by
``dflash-eval`` (cli/eval.py) and by the in-training evaluation; nothing here touches torch.distributed."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from dflash_dist.config import ConfigError, DataConfig, TargetConfig
from dflash_dist.data.batching import holdout_size, split_holdout
from dflash_dist.data.conversations import PACKAGED_SOURCES, BadDataStats, builtin_conversations
from dflash_dist.data.sources import read_conversations

log = logging.getLogger("dflash_dist")


__all__ = ["eos_token_ids", "prompt_messages", "encode_prompts", "prompts_from_jsonl", "holdout_conversations",
           "load_drafter", "EvalSetup"]


def eos_token_ids(tokenizer, hf_config=None) -> list[int]:
    """Stop tokens: the config's and tokenizer's EOS ids plus the chat template's end-of-turn token
    (``<|im_end|>`` for ChatML) when it is a single token."""
    ids: list[int] = []

    def add(x):
        if x is None:
            return
        for i in (x if isinstance(x, (list, tuple)) else [x]):
            if i is not None and int(i) >= 0 and int(i) not in ids:
                ids.append(int(i))

    if hf_config is not None:
        from dflash_dist.targets.hf import text_config
        add(getattr(text_config(hf_config), "eos_token_id", None))
        add(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
        from dflash_dist.data.template import template_info
        try:
            close = template_info(tokenizer).close
        except Exception:
            close = ""
        if close:
            enc = tokenizer(close, add_special_tokens=False)["input_ids"]
            if len(enc) == 1:
                add(enc[0])
    return ids


def prompt_messages(conv: dict) -> list[dict]:
    """The messages before the first assistant turn (what the model answers), or a ``prompt`` string as a
    user turn. Raises ValueError when there is no user turn to answer."""
    if isinstance(conv.get("prompt"), str):
        return [{"role": "user", "content": conv["prompt"]}]
    msgs = conv.get("messages")
    if not isinstance(msgs, list):
        raise ValueError("row has neither 'messages' nor 'prompt'")
    out = []
    for m in msgs:
        if m.get("role") == "assistant":
            break
        out.append({"role": m["role"], "content": m["content"]})
    if not out or out[-1]["role"] != "user":
        raise ValueError("no user turn before the first assistant turn")
    return out


def encode_prompts(tokenizer, conversations: Sequence[dict], chat_template_kwargs: Optional[dict] = None
                   ) -> list[list[int]]:
    """Token ids of each conversation's prompt (chat template + generation prompt, no extra special tokens)."""
    out = []
    for conv in conversations:
        text = tokenizer.apply_chat_template(prompt_messages(conv), tokenize=False, add_generation_prompt=True,
                                             **(chat_template_kwargs or {}))
        out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


def prompts_from_jsonl(path: str) -> list[dict]:
    """Rows of a prompt file (``{"messages": ...}`` or ``{"prompt": ...}``); unusable rows are skipped and
    counted in a warning. Also reads the training run's ``data_cache/holdout-*.jsonl``."""
    rows, bad = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt_messages(row)
            except (ValueError, KeyError, TypeError, AttributeError):
                bad += 1
                continue
            rows.append(row)
    if bad:
        log.warning("%s: skipped %d unusable rows", path, bad)
    return rows


def spread_subset(rows: Sequence, n: int, seed: int = 0) -> list:
    """``n`` of ``rows`` drawn at random (fixed seed), kept in their order; all of them if there are no more.

    Not the first ``n``: the held-out conversations come in corpus order, and a corpus grouped by topic or source
    gives its first rows a tau of their own (on the tiny default the first 64 of 256 held-out prompts have none
    that ends in its first block, the whole set 134)."""
    n = max(0, int(n))
    if len(rows) <= n:
        return list(rows)
    import random
    return [rows[i] for i in sorted(random.Random(f"eval:{seed}").sample(range(len(rows)), n))]


def holdout_conversations(data_cfg: DataConfig) -> list[dict]:
    """The held-out conversations of a training run with this data section (same source, same split)."""
    if data_cfg.holdout <= 0:
        raise ConfigError("the run kept no held-out conversations (data.holdout=0): pass --prompts FILE")
    if data_cfg.source in PACKAGED_SOURCES:
        convs = builtin_conversations(data_cfg.source)
    else:
        if not os.path.exists(data_cfg.source):
            raise ConfigError(f"data.source={data_cfg.source!r} of the run is not here: pass --prompts FILE")
        convs = read_conversations(data_cfg.source, BadDataStats())
    n_hold = holdout_size(len(convs), data_cfg.holdout)  # as the training run split it (data/prepare.py)
    if n_hold == 0:
        raise ConfigError(f"the run kept no held-out conversations ({len(convs)} conversations: the holdout is at "
                          f"most 10%): pass --prompts FILE")
    _, held = split_holdout(len(convs), n_hold, data_cfg.shuffle_seed)
    return [convs[i] for i in held]


@dataclass
class EvalSetup:
    drafter: Any
    layer_ids: list
    mask_token_id: int
    block_size: int
    target: Optional[TargetConfig]
    data: Optional[DataConfig]
    tokenizer: Optional[str]
    source: str
    chat_template_kwargs: Optional[dict] = None  # what training rendered the chat template with
    eval_max_new_tokens: Optional[int] = None  # the run's in-training evaluation length (checkpoints only)


def load_drafter(checkpoint: Optional[str] = None, export: Optional[str] = None, device: str = "cpu") -> EvalSetup:
    """Drafter (fp32, eval, SDPA backend) and what is needed to rebuild its target, from a checkpoint or export.
    Raises ``CheckpointError`` (one line naming the file and field) for files that do not check out. The target
    section, tokenizer and data returned came from a file: load them local-only (cli/eval.py)."""
    if (checkpoint is None) == (export is None):
        raise ConfigError("give exactly one of --checkpoint DIR or --export DIR")
    from dflash_dist.checkpoint.store import CheckpointError
    if checkpoint is not None:
        from dflash_dist.checkpoint.store import load_checkpoint
        from dflash_dist.checkpoint.validate import bare_name
        try:  # every file checked (checkpoint/validate.py), the weights against drafter_config, before any build
            weights, _, meta = load_checkpoint(checkpoint, optimizer=False)  # never opens optimizer.pt
        except CheckpointError:
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from e
        for key in ("drafter_config", "layer_ids", "mask_token_id"):
            if key not in meta:
                raise CheckpointError(f"{os.path.join(checkpoint, 'meta.json')}: {key}: missing")
        from dflash_dist.checkpoint.meta import meta_block_size, meta_model
        model = meta_model(meta, "sdpa")  # the recorded variant's module
        model.load_state_dict({bare_name(k): v for k, v in weights.items()})
        model.to(device).eval().requires_grad_(False)
        job = meta.get("job_config") or {}
        tgt = TargetConfig(**job["target"]) if job.get("target") else None
        dat = DataConfig(**job["data"]) if job.get("data") else None
        kw = meta.get("chat_template_kwargs", (job.get("data") or {}).get("chat_template_kwargs"))
        n_new = (job.get("train") or {}).get("eval_max_new_tokens")
        return EvalSetup(model, list(meta["layer_ids"]), int(meta["mask_token_id"]), meta_block_size(meta), tgt,
                         dat, meta.get("tokenizer"), os.path.abspath(checkpoint), kw,
                         int(n_new) if isinstance(n_new, int) and n_new > 0 else None)
    from dflash_dist.export.load import ExportError, load_export
    try:
        model, meta = load_export(export, device=device)
    except CheckpointError:
        raise
    except ExportError as e:
        raise ConfigError(str(e)) from e
    tgt = TargetConfig(**meta["target"]) if meta.get("target") else None
    dat = DataConfig(**meta["data"]) if meta.get("data") else None
    kw = meta.get("chat_template_kwargs", (meta.get("data") or {}).get("chat_template_kwargs"))
    return EvalSetup(model, meta["layer_ids"], meta["mask_token_id"], meta["block_size"], tgt, dat,
                     meta.get("tokenizer"), os.path.abspath(export), kw)


def check_pair(target, setup: EvalSetup) -> None:
    from dflash_dist.targets.hf import decoder_layers, text_config
    tc = text_config(target.config)
    dc = setup.drafter.config
    n_layers = len(decoder_layers(target)[1])
    if tc.hidden_size != dc.hidden_size:
        raise ConfigError(f"target hidden_size {tc.hidden_size} != drafter hidden_size {dc.hidden_size}: wrong target")
    bad = [i for i in setup.layer_ids if not 0 <= i < n_layers]
    if bad:
        raise ConfigError(f"drafter layer ids {bad} out of range for a {n_layers}-layer target: wrong target")
    if not 0 <= setup.mask_token_id < tc.vocab_size:
        raise ConfigError(f"mask token {setup.mask_token_id} outside the target vocabulary ({tc.vocab_size})")
