"""Batched generation of the final assistant reply of conversation rows with the target (``dflash-regenerate``).

Prompts are rendered with the chat template and its generation prompt, sorted by length and batched with left
padding for HF ``generate``, so every row of a batch ends where its reply starts and padding leaves each row's
computation alone: greedy rows are the same at any batch size, which is what lets a batch that runs out of device
memory be split (``ShrinkingBatches``) without changing the output. Sampling seeds each batch from the run's seed
and the batch's first row, so a rerun reproduces it. The reply is cut at the first EOS and decoded; one that
decodes to nothing or spells a special token would be refused by the training data reader, so it is replaced by
the original reply, dropped or kept (``on_empty``), and every outcome is counted.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from dflash_dist.data.shrinking_batches import ShrinkingBatches
from dflash_dist.data.template import template_info


@torch.inference_mode()
def regenerate_rows(model, tokenizer, items: list, *, max_new_tokens: int, temperature: float, top_p: float,
                    batch_size: int, top_k: int = 0, eos_ids: list, on_empty: str, seed: int,
                    chat_template_kwargs: Optional[dict] = None, max_positions: Optional[int] = None,
                    progress=None, on_batch=None, rank: int = 0) -> tuple[list[tuple[int, dict]], dict]:
    """Generate the final reply of each ``(index, row, prompt messages, original reply)``.

    Returns ([(index, output row)], counts). Batches are formed from length-sorted prompts (left padding);
    with sampling, each batch uses a generator seeded from ``seed`` and its first index, so a rerun with the
    same world size and batch size reproduces the output. ``on_batch(rows, counts)``: called with each finished
    batch's output rows and its counts (the CLI appends them to its part file).

    A batch that runs out of device memory is retried as two halves, and the smaller size kept for the batches
    after it (``ShrinkingBatches``; greedy rows are the same at any batch size, as left padding leaves each row's
    computation alone); the counts then hold ``oom_halvings`` and ``batch_size_reduced_to``. A row that does not
    fit alone raises ``RowTooLarge``."""
    device = next(model.parameters()).device
    counts = {"generated": 0, "empty_replaced": 0, "empty_dropped": 0, "empty_kept": 0, "too_long": 0,
              "hit_max_new_tokens": 0, "new_tokens": 0}
    specials = [s for s in template_info(tokenizer, chat_template_kwargs).specials if s]
    enc = []
    for index, row, msgs, original in items:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                             **(chat_template_kwargs or {}))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if max_positions is not None and len(ids) + max_new_tokens > max_positions:
            counts["too_long"] += 1
            continue
        enc.append((index, row, msgs, original, ids))
    enc.sort(key=lambda e: (len(e[4]), e[0]))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    eos_set = set(eos_ids)
    out: list[tuple[int, dict]] = []
    reported: dict = {}

    def generate(batch):
        width = max(len(e[4]) for e in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for i, e in enumerate(batch):
            input_ids[i, width - len(e[4]):] = torch.tensor(e[4])
            attn[i, width - len(e[4]):] = 1
        gen_kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, eos_token_id=list(eos_ids),
                                          pad_token_id=pad_id, use_cache=True)
        if temperature > 0:
            gen_kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
            torch.manual_seed(seed * 1_000_003 + batch[0][0])
        else:
            gen_kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        seqs = model.generate(input_ids=input_ids.to(device), attention_mask=attn.to(device), **gen_kwargs)
        return seqs[:, width:].tolist()

    def describe(e):
        return f"usable row {e[0]} (0-based; {len(e[4])} prompt tokens + up to {max_new_tokens} new)"

    batches = ShrinkingBatches(batch_size, device=device, label=f"rank {rank}")
    finished = 0
    for batch, new in batches.run(enc, generate, describe):
        done_before = len(out)
        for e, toks in zip(batch, new):
            index, row, msgs, original, _ = e
            cut = len(toks)
            for j, t in enumerate(toks):
                if t in eos_set:
                    cut = j
                    break
            counts["new_tokens"] += cut
            if cut == len(toks) and len(toks) >= max_new_tokens:
                counts["hit_max_new_tokens"] += 1
            text = tokenizer.decode(toks[:cut], skip_special_tokens=True)
            if any(sp in text for sp in specials):
                # ordinary tokens that spell a special token: the row would be refused by the data reader
                counts["special_token_text"] = counts.get("special_token_text", 0) + 1
                text = ""
            if not text.strip():
                if on_empty == "drop" or (on_empty == "original" and original is None):
                    counts["empty_dropped"] += 1
                    continue
                if on_empty == "original":
                    counts["empty_replaced"] += 1
                    text = original
                else:
                    counts["empty_kept"] += 1
            res = {k: v for k, v in row.items() if k != "messages"}
            res = {"messages": msgs + [{"role": "assistant", "content": text}], **res}
            out.append((index, res))
            counts["generated"] += 1
        if batches.halvings:
            counts["oom_halvings"] = batches.halvings
        if on_batch is not None:  # counts since the last call (the first also holds the prompts too long)
            on_batch(out[done_before:], {k: v - reported.get(k, 0) for k, v in counts.items()})
            reported = dict(counts)
        finished += len(batch)
        if progress is not None:
            progress(finished, len(enc))
    if batches.halvings:  # not a count (never summed): the size this process ended at
        counts["batch_size_reduced_to"] = batches.size
    out.sort(key=lambda x: x[0])
    return out, counts
