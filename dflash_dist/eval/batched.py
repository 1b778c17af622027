"""Greedy speculative decoding of several prompts at once (``dflash-eval --batch-size N``): one drafter forward and
one target verify forward per step for the whole batch, where :func:`~dflash_dist.eval.spec_decode.speculative_steps`
runs both per prompt.

The rows accept different numbers of tokens, so the target's KV cache cannot be cut back per row. Every verify
appends the whole block to the cache; the positions a row rejected stay there, masked out of every later query by
a 4-D attention mask this module builds (left padding of the prompts likewise). Each row's positions and its
drafter context are its own, so each row decodes as it would alone: the same tokens and acceptance lengths up to
floating-point differences between a batched and a one-row forward (exact in float32 on CPU in the tests; in bf16
a near tie can flip, as between a block and a one-token forward).

Needs a target whose cache holds only full attention (``cache_supported``) and an eager or SDPA attention
implementation (the mask is passed whole, as an additive float mask)."""

from __future__ import annotations

import time
from typing import Iterable, Sequence

import torch
from torch import Tensor, nn

from dflash_dist.eval.drafting import draft_rows, unwrap_drafter
from dflash_dist.eval.target_runner import TargetRunner, cache_supported, new_cache
from dflash_dist.targets.hf import head_weights

__all__ = ["batched_speculative", "check_batchable"]


def check_batchable(target) -> None:
    """Refuses a target that batched decoding cannot serve exactly (ValueError naming why)."""
    if not cache_supported(target):
        raise ValueError("batched evaluation needs a target whose KV cache holds only full attention layers "
                         "(this one has other layers or no cache argument): use batch size 1")
    impl = getattr(target.config, "_attn_implementation", None) or "eager"
    if impl not in ("eager", "sdpa"):
        raise ValueError(f"batched evaluation passes its own attention mask, which the target's attention "
                         f"implementation {impl!r} does not take: use --attn-implementation sdpa or batch size 1")


def _mask(valid: Tensor, q_len: int, dtype: torch.dtype) -> Tensor:
    """Additive mask [N, 1, q_len, K] of the last ``q_len`` cache positions as queries: a key is seen if it is valid
    and not after the query; every query also sees itself (a padding or rejected row is never empty: no NaN)."""
    k_len = valid.shape[1]
    k = torch.arange(k_len, device=valid.device)
    q = torch.arange(k_len - q_len, k_len, device=valid.device)
    seen = (valid[:, None, :] & (k[None, :] <= q[:, None])[None]) | (k[None, :] == q[:, None])[None]
    out = torch.zeros(seen.shape, dtype=dtype, device=valid.device)
    return out.masked_fill_(~seen, torch.finfo(dtype).min)[:, None]


@torch.inference_mode()
def _decode(target, model, embed, lm_head, runner: TargetRunner, prompts: list, mask_token_id: int, B: int,
            max_new_tokens: int, eos: set) -> list:
    dev = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    n = len(prompts)
    lens = [len(x) for x in prompts]
    width = max(lens)
    ids = torch.zeros(n, width, dtype=torch.long, device=dev)
    valid = torch.zeros(n, width, dtype=torch.bool, device=dev)
    for r, x in enumerate(prompts):  # left padding: every row's last prompt token at the same cache position
        ids[r, width - lens[r]:] = torch.as_tensor(x, dtype=torch.long, device=dev)
        valid[r, width - lens[r]:] = True
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
    cache = new_cache(target)
    logits, feats = runner(ids, 0, cache, keep=1, attention_mask=_mask(valid, width, dtype), position_ids=pos)
    contexts = [feats[r, width - lens[r]:] for r in range(n)]
    bonus = logits[:, -1].argmax(-1)
    p = torch.tensor(lens, device=dev)
    out = [[] for _ in range(n)]
    acc_lens = [[] for _ in range(n)]
    per_pos = [[0] * (B - 1) for _ in range(n)]
    stop = ["max_new_tokens"] * n
    done = [False] * n

    def emit(r: int, tokens: list) -> None:
        for t in tokens:
            out[r].append(t)
            if t in eos:
                stop[r], done[r] = "eos", True
                return
            if len(out[r]) >= max_new_tokens:
                done[r] = True
                return

    for r in range(n):
        emit(r, [int(bonus[r])])
    while not all(done):
        block = torch.full((n, B), int(mask_token_id), dtype=torch.long, device=dev)
        block[:, 0] = bonus
        block[:, 1:] = draft_rows(model, embed, lm_head, contexts, block, p).to(dev)
        valid = torch.cat([valid, torch.ones(n, B, dtype=torch.bool, device=dev)], dim=1)
        logits, feats = runner(block, valid.shape[1] - B, cache, keep=B,
                               attention_mask=_mask(valid, B, dtype), position_ids=p[:, None] + torch.arange(B, device=dev))
        posterior = logits.argmax(-1)                                        # [N, B]: predictions for p+1..p+B
        acc = (block[:, 1:] == posterior[:, :-1]).long().cumprod(1).sum(1)   # [N]
        acc_host, block_host, post_host = acc.tolist(), block.tolist(), posterior.tolist()
        for r in range(n):
            a = acc_host[r]
            if done[r]:  # a finished row rides along: its block is masked out and nothing is counted
                valid[r, -B:] = False
                continue
            valid[r, valid.shape[1] - B + a + 1:] = False                   # the rejected positions (none at a = B-1)
            acc_lens[r].append(a + 1)
            per_pos[r] = [c + int(k < a) for k, c in enumerate(per_pos[r])]
            contexts[r] = torch.cat([contexts[r], feats[r, :a + 1]], dim=0)
            emit(r, block_host[r][1:a + 1] + [post_host[r][a]])
            bonus[r] = post_host[r][a]
        p = p + acc + 1
    return [(out[r], acc_lens[r], per_pos[r], stop[r], lens[r]) for r in range(n)]


def batched_speculative(target, drafter: nn.Module, embed, lm_head, prompts: Sequence, layer_ids: Sequence[int],
                        mask_token_id: int, block_size: int, max_new_tokens: int, eos_ids: Iterable[int] = (),
                        batch_size: int = 8) -> list:
    """[(new token ids, stats)] per prompt, in order, as :func:`~dflash_dist.eval.spec_decode.speculative_generate`
    returns them, ``batch_size`` prompts decoded together; a row's ``wall_s`` is its batch's time over its rows."""
    if block_size < 2:
        raise ValueError(f"block_size={block_size}: must be >= 2")
    check_batchable(target)
    if embed is None or lm_head is None:
        e, h = head_weights(target)
        embed = e if embed is None else embed
        lm_head = h if lm_head is None else lm_head
    model = unwrap_drafter(drafter)
    runner = TargetRunner(target, layer_ids)
    eos = {int(i) for i in eos_ids}
    rows = [[int(t) for t in torch.as_tensor(x).reshape(-1).tolist()] for x in prompts]
    if any(not x for x in rows):
        raise ValueError("empty prompt")
    results = []
    for i in range(0, len(rows), max(1, int(batch_size))):
        chunk = rows[i:i + max(1, int(batch_size))]
        t0 = time.monotonic()
        if max_new_tokens <= 0:
            decoded = [([], [], [0] * (block_size - 1), "max_new_tokens", len(x)) for x in chunk]
        else:
            with runner.attached():
                decoded = _decode(target, model, embed, lm_head, runner, chunk, mask_token_id, int(block_size),
                                  max_new_tokens, eos)
        wall = (time.monotonic() - t0) / len(chunk)
        for toks, lens, per_pos, stop, n_prompt in decoded:
            results.append((toks, {"acceptance_lengths": lens, "steps": len(lens),
                                   "tau": (sum(lens) / len(lens)) if lens else None, "accepted_per_position": per_pos,
                                   "new_tokens": len(toks), "prompt_tokens": n_prompt, "stop": stop, "wall_s": wall}))
    return results
