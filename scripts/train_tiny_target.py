#!/usr/bin/env python
"""Train the packaged tiny Qwen3 target on the chatterbot English dialogues (CPU, fp32, 2 threads).

Writes ``dflash_dist/assets/tiny/model.safetensors`` (fp32, ~8.4 MB) next to the config and tokenizer that
``scripts/build_tiny_tokenizer.py`` wrote, so ``AutoModelForCausalLM.from_pretrained("dflash_dist/assets/tiny")``
loads it.

Every token of the ChatML-formatted dialogues is supervised, not only the replies: user and bot lines are the
same kind of short English, so this doubles the text a 2M-parameter model learns from, and the model also
learns the turn structure (close a reply with ``<|im_end|>``, which greedy generation stops on).

Reproducible: fixed seeds, fixed thread count, deterministic algorithms, a fixed number of steps (not a time
budget), batches from ``dflash_dist.data.batching.build_plan``. Bit-identical output needs the same torch build and
CPU kind (float reductions depend on the vector unit).

Usage: python scripts/train_tiny_target.py [--epochs 16] [--out dflash_dist/assets/tiny]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from dflash_dist.data import batching as data_plan  # noqa: E402
from dflash_dist.data import (
    conversations,  # noqa: E402
    tokenize,  # noqa: E402
)

PROMPTS = [
    "Hello",
    "How are you doing?",
    "What is AI?",
    "Tell me a joke.",
    "What is your favorite book?",
    "What is a computer virus?",
    "Who was the first president of the United States?",
    "Do you like sports?",
]


def build_batches(tokenizer, epochs: int, seed: int, max_batch_tokens: int, max_batch_samples: int):
    convs = conversations.chatterbot_conversations()
    seqs = []
    for c in convs:
        r = tokenize.tokenize_conversation(tokenizer, c, max_length=512, overlong="truncate")
        if isinstance(r, str):
            raise SystemExit(f"corpus conversation failed to tokenize: {r}")
        seqs.append(r[0])
    lengths = [len(s) for s in seqs]
    plan = data_plan.build_plan(lengths, range(len(seqs)), epochs=epochs, seed=seed,
                           max_batch_tokens=max_batch_tokens, max_batch_samples=max_batch_samples)
    return seqs, plan


def collate(seqs, batch, pad_id: int):
    L = max(len(seqs[i]) for i in batch)
    ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
    att = torch.zeros((len(batch), L), dtype=torch.long)
    for r, i in enumerate(batch):
        s = torch.tensor(seqs[i], dtype=torch.long)
        ids[r, : len(s)] = s
        att[r, : len(s)] = 1
    labels = ids.masked_fill(att == 0, -100)
    return ids, att, labels


@torch.no_grad()
def mean_loss(model, seqs, plan_epoch, pad_id):
    model.eval()
    tot, n = 0.0, 0
    for b in plan_epoch:
        ids, att, labels = collate(seqs, b, pad_id)
        k = int((labels[:, 1:] != -100).sum())
        tot += float(model(input_ids=ids, attention_mask=att, labels=labels).loss) * k
        n += k
    model.train()
    return tot / n


@torch.no_grad()
def greedy(model, tokenizer, prompt: str, max_new_tokens: int = 48) -> str:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    stop = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    out = []
    for _ in range(max_new_tokens):
        nxt = int(model(input_ids=ids).logits[0, -1].argmax())
        if nxt in stop:
            break
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return tokenizer.decode(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=conversations.ASSETS_TINY)
    ap.add_argument("--epochs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--max-batch-samples", type=int, default=32)
    args = ap.parse_args()

    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.use_deterministic_algorithms(True)
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.out)
    cfg = AutoConfig.from_pretrained(args.out)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    model.train()
    pad_id = tokenizer.pad_token_id
    seqs, plan = build_batches(tokenizer, args.epochs, args.seed, args.max_batch_tokens, args.max_batch_samples)
    steps = len(plan)
    per_epoch = steps // args.epochs
    print(f"{len(seqs)} dialogues, {sum(map(len, seqs))} tokens/epoch, {args.epochs} epochs, {steps} steps, "
          f"{sum(p.numel() for p in model.parameters())} params", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    warmup = min(100, steps // 10)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))

    t0 = time.time()
    ema = None
    for step, batch in enumerate(plan):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        ids, att, labels = collate(seqs, batch, pad_id)
        loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = float(loss.detach())
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:5d}/{steps} epoch {step // max(1, per_epoch)} loss {lv:.4f} "
                  f"ema {ema:.4f} lr {lr_at(step):.2e} {time.time() - t0:.0f}s", flush=True)

    final = mean_loss(model, seqs, plan[:per_epoch], pad_id)
    print(f"final train loss (one pass over all dialogues, eval mode): {final:.4f} "
          f"(ppl {math.exp(final):.2f}); training took {time.time() - t0:.0f}s", flush=True)

    path = os.path.join(args.out, "model.safetensors")
    tmp = path + ".tmp"
    state = {k: v.detach().contiguous().float() for k, v in model.state_dict().items()}
    save_file(state, tmp, metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    print(f"wrote {path} ({os.path.getsize(path) / 1e6:.2f} MB)")

    loaded = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    loaded.eval()
    model.eval()
    probe = torch.tensor([seqs[0]])
    assert torch.equal(loaded(input_ids=probe).logits, model(input_ids=probe).logits), "reloaded model differs"
    for p in PROMPTS:
        print(f"  user: {p!r}\n  tiny: {greedy(loaded, tokenizer, p)!r}")


if __name__ == "__main__":
    main()
