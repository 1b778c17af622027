"""The drafter's side of speculative decoding: greedy drafts of one block or of several rows at once, as
evaluation (eval/spec_decode.py, eval/batched.py) runs them."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_dist.model.masks import dense_mask

__all__ = ["DraftFn", "draft_rows", "make_dflash_draft_fn", "unwrap_drafter"]

DraftFn = Callable[[Tensor, Tensor, int], Tensor]
"""``draft_fn(context_features [1, p, n*H], block_ids [1, B], p) -> draft ids [B-1]`` (slots 1..B-1)."""


def unwrap_drafter(module: nn.Module) -> nn.Module:
    while hasattr(module, "module") and isinstance(module.module, nn.Module):  # DDP / wrappers
        module = module.module
    return getattr(module, "_orig_mod", module)  # torch.compile


def draft_rows(model: nn.Module, embed: Tensor, lm_head: Tensor, contexts: Sequence[Tensor], block: Tensor,
               p: Tensor) -> Tensor:
    """The greedy drafts [N, B-1] of N blocks with the drafter ``model`` (unwrapped; any backend, run with SDPA):
    row r's block ``block[r]`` at positions p[r].., its context ``contexts[r]`` [p[r], n*H] (right-padded to the
    longest: training's ``kv < anchor`` rule hides the padding), then the model's ``propose``. On CUDA an fp32
    drafter runs under bf16 autocast, as in training."""
    w = model.fc.weight
    dev = w.device
    n, b_len = block.shape
    longest = max(int(c.shape[0]) for c in contexts)
    if n == 1:  # one prompt (the in-training evaluation's default): its context as it is, no padded copy
        ctx = contexts[0][None].to(dev)
    else:
        ctx = torch.zeros(n, longest, contexts[0].shape[-1], dtype=contexts[0].dtype, device=dev)
        for r, c in enumerate(contexts):
            ctx[r, :c.shape[0]] = c
    block = block.to(dev)
    anchors = p.to(dev).reshape(n, 1)
    ctx_pos = torch.arange(longest, device=dev)[None].expand(n, -1)
    blk_pos = anchors + torch.arange(b_len, device=dev)[None]
    mask = dense_mask(anchors, torch.ones_like(anchors, dtype=torch.bool), longest, b_len)
    saved = model.backend
    model.backend = "sdpa"  # shapes change every block: no flex recompiles; the dense mask is tiny here
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda" and w.dtype == torch.float32):
            hidden = model(F.embedding(block, embed.to(dev)), ctx, ctx_pos, blk_pos, mask)
    finally:
        model.backend = saved
    model.set_context(block_ids=block, embed=embed)
    # the variant's proposal step (DFlash: argmax of the logits; DFlash2: the selector's walk from the anchor)
    return model.propose(hidden, lm_head, block[:, 0])


def make_dflash_draft_fn(drafter: nn.Module, embed: Tensor, lm_head: Tensor) -> DraftFn:
    """The greedy draft step of a :class:`~dflash_dist.model.drafter.DFlashDrafter` or a variant's subclass
    (:func:`draft_rows` of one block). ``embed``/``lm_head`` [V, H] are the target's (frozen) weights."""
    model = unwrap_drafter(drafter)

    def draft(context: Tensor, block_ids: Tensor, p: int) -> Tensor:
        return draft_rows(model, embed, lm_head, [context[0]], block_ids, torch.tensor([p]))[0]

    return draft
