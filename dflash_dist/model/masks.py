"""The DFlash attention mask, as a dense bool mask (sdpa backend) and as a flex_attention BlockMask.

Layout of one step (b samples, N blocks of B slots each, Q = N*B queries)::

    keys = [ context keys 0 .. ctx_len-1 | block keys: block 0 slots, block 1 slots, ... ]   (K = ctx_len + Q)

A query in block i (anchor a_i, valid) sees

* context key j  iff  j < a_i   -- strictly before the anchor. The anchor token itself enters the block as
  slot 0 (its embedding), and the target's feature at position a_i was computed *from* token a_i; the
  drafter at inference only has target features of tokens that were already verified, i.e. positions < a_i.
* every slot of its own block (bidirectional inside the block);
* nothing of other blocks.

A padding block (valid False) sees nothing: flex returns 0 for such rows, the sdpa backend zeroes them.
Because anchors are < the sample's true length, padded context positions are never visible.

``context_inclusive=True`` switches the context rule to ``j <= a_i``. THIS IS A BUG (the classic leak: the
feature at the anchor position already encodes the anchor's hidden state, which the drafter would not have
at inference) and exists only for the leak demonstration script; never use it for training.

Both forms are computed from the same two per-block integers so they cannot drift apart:
``limit[b, i]`` (context keys < limit are visible; 0 for padding blocks) and ``block_id[b, i]`` (i, or -1 for
padding blocks).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

__all__ = ["dense_mask", "make_mask_mod", "flex_block_mask", "mask_build_calls"]

# Module-level compiled builder: compiled once per process, new mask_mods (fresh closures over new anchor
# tensors) reuse the graph because dynamo guards on the closure tensors' metadata, not their identity.
_create_block_mask_compiled = torch.compile(create_block_mask)
_create_block_mask_compiled_dynamic = torch.compile(create_block_mask, dynamic=True)  # CUDA: one graph for all shapes

mask_build_calls: dict = {"compiled": 0, "eager": 0}
"""How often flex_block_mask took each path (tests and the startup banner read it)."""


def _block_tables(anchors: Tensor, valid: Tensor, context_inclusive: bool) -> tuple[Tensor, Tensor]:
    """Per-block ``limit`` (visible context keys are j < limit) and ``block_id`` (-1 for padding), [b, N] long."""
    if anchors.dim() != 2 or valid.shape != anchors.shape:
        raise ValueError(f"anchors {tuple(anchors.shape)} and valid {tuple(valid.shape)} must both be [b, N]")
    anchors = anchors.long()
    valid = valid.bool()
    limit = torch.where(valid, anchors + int(context_inclusive), torch.zeros_like(anchors))
    ids = torch.arange(anchors.shape[1], device=anchors.device).expand_as(anchors)
    block_id = torch.where(valid, ids, torch.full_like(anchors, -1))
    return limit, block_id


def dense_mask(anchors: Tensor, valid: Tensor, ctx_len: int, block_size: int,
               context_inclusive: bool = False) -> Tensor:
    """Bool mask [b, N*B, ctx_len + N*B], True = query may attend to key (see the module docstring)."""
    limit, block_id = _block_tables(anchors, valid, context_inclusive)
    b, n = limit.shape
    dev = limit.device
    q_block = torch.arange(n * block_size, device=dev) // block_size                  # [Q]
    ctx = torch.arange(ctx_len, device=dev)[None, None, :] < limit[:, q_block, None]  # [b, Q, ctx_len]
    own = block_id[:, q_block, None] == q_block[None, None, :]                        # [b, Q, Q]
    return torch.cat([ctx, own], dim=-1)


def make_mask_mod(anchors: Tensor, valid: Tensor, ctx_len: int, block_size: int, context_inclusive: bool = False):
    """flex_attention ``mask_mod(b, h, q_idx, kv_idx)`` implementing the same rule as :func:`dense_mask`."""
    limit, block_id = _block_tables(anchors, valid, context_inclusive)

    def dflash_mask_mod(b, h, q_idx, kv_idx):
        i = q_idx // block_size
        in_ctx = kv_idx < limit[b, i]  # limit <= anchor+1 <= ctx_len, so this only ever hits context keys
        in_own_block = (kv_idx >= ctx_len) & ((kv_idx - ctx_len) // block_size == block_id[b, i])
        return in_ctx | in_own_block

    return dflash_mask_mod


def flex_block_mask(anchors: Tensor, valid: Tensor, ctx_len: int, block_size: int, compile: bool = True,
                    context_inclusive: bool = False, dynamic: bool = False) -> BlockMask:
    """BlockMask for one step (H=None: shared by all heads), built once and reused by every layer.

    ``compile=True`` uses the module-level ``torch.compile(create_block_mask)`` on accelerators, so the
    [b, Q, K] mask is never materialised. On CPU the eager builder is used even with compile=True: inductor's
    CPU backend miscompiles this reduction in torch 2.13 (C++ VecMask type error), and the eager (vmap) path
    is cheap at CPU sizes. ``dynamic=True`` (CUDA) uses the dynamic-shape compiled builder, so new (b, S_pad)
    shapes do not recompile. ``mask_build_calls`` records which path ran.
    """
    b, n = anchors.shape
    q_len = n * block_size
    mask_mod = make_mask_mod(anchors, valid, ctx_len, block_size, context_inclusive)
    if compile and anchors.device.type != "cpu":
        mask_build_calls["compiled"] += 1
        builder = _create_block_mask_compiled_dynamic if dynamic else _create_block_mask_compiled
    else:
        mask_build_calls["eager"] += 1
        builder = create_block_mask
    return builder(mask_mod, b, None, q_len, ctx_len + q_len, device=anchors.device)
