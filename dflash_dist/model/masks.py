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

Sliding-window layers (``sliding_window=W``, the drafter's ``sliding_attention`` layers) keep the rule above and
also need the key within W positions of the query, both ways, on absolute positions: slot s of block i (position
a_i + s) sees context key j iff j < a_i and a_i + s - j < W, and slot s' of its own block iff |s - s'| < W. This
is the non-causal window of the z-lab reference (``dflash/model.py`` ``_attention_mask``: ``q - k < W`` and
``k - q < W``) and of vLLM (``qwen3_dflash.py``: a symmetric window for non-causal sliding layers, PR #46104).
:func:`window_mask` gives the same restriction from positions alone (the drafter's sdpa path uses it when it is
handed one full-attention mask).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

try:  # dense tile table -> (count, sorted indices) per row, as create_block_mask's last step (torch 2.5 .. 2.13)
    from torch.nn.attention.flex_attention import _dense_to_ordered
except ImportError:  # a later torch without it: the compiled builder below still works
    _dense_to_ordered = None

from dflash_dist.model.lazy_compile import lazy_compile

__all__ = ["dense_mask", "make_mask_mod", "flex_block_mask", "tile_tables", "block_mask_from_tables", "window_mask",
           "layer_masks", "visible_pairs", "mask_build_calls"]

# Module-level compiled builder: compiled once per process, new mask_mods (fresh closures over new anchor
# tensors) reuse the graph because dynamo guards on the closure tensors' metadata, not their identity.
_create_block_mask_compiled = lazy_compile(create_block_mask)
_create_block_mask_compiled_dynamic = lazy_compile(create_block_mask, dynamic=True)  # CUDA: one graph for all shapes

mask_build_calls: dict = {"tables": 0, "compiled": 0, "eager": 0}
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


def _check_window(sliding_window) -> None:
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window={sliding_window}: must be >= 1 (or None for full attention)")


def dense_mask(anchors: Tensor, valid: Tensor, ctx_len: int, block_size: int,
               context_inclusive: bool = False, sliding_window: Optional[int] = None) -> Tensor:
    """Bool mask [b, N*B, ctx_len + N*B], True = query may attend to key (see the module docstring);
    ``sliding_window``: the sliding-window layers' mask."""
    _check_window(sliding_window)
    limit, block_id = _block_tables(anchors, valid, context_inclusive)
    b, n = limit.shape
    dev = limit.device
    q_idx = torch.arange(n * block_size, device=dev)
    q_block = q_idx // block_size                                                     # [Q]
    ctx = torch.arange(ctx_len, device=dev)[None, None, :] < limit[:, q_block, None]  # [b, Q, ctx_len]
    own = block_id[:, q_block, None] == q_block[None, None, :]                        # [b, Q, Q]
    if sliding_window is not None:
        w = int(sliding_window)
        q_pos = anchors.long()[:, q_block] + (q_idx % block_size)[None]               # [b, Q] a_i + s
        ctx = ctx & (q_pos[:, :, None] - torch.arange(ctx_len, device=dev)[None, None, :] < w)
        slot = q_idx % block_size
        own = own & ((slot[:, None] - slot[None, :]).abs() < w)[None]
    return torch.cat([ctx, own], dim=-1)


def window_mask(q_positions: Tensor, k_positions: Tensor, sliding_window: int) -> Tensor:
    """Bool [b, Q, K]: |q_pos - k_pos| < W. ``dense_mask(..., sliding_window=W)`` equals
    ``dense_mask(...) & window_mask(block_positions, [ctx_positions | block_positions], W)`` (tested)."""
    _check_window(sliding_window)
    return (q_positions[:, :, None] - k_positions[:, None, :]).abs() < int(sliding_window)


def _row_intervals(anchors: Tensor, valid: Tensor, ctx_len: int, block_size: int, context_inclusive: bool = False,
                   sliding_window: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The two key intervals each query row sees, (ctx_lo, ctx_hi, own_lo, own_hi), each [b, N, B] long: query
    slot s of block i sees context keys [ctx_lo, ctx_hi) = [lo, limit_i), lo = 0 (full attention) or
    anchor_i + s - W + 1 (``sliding_window`` W), and, if its block is valid, its own block's slots t with
    |s - t| < W (all of them without a window), keys [own_lo, own_hi) within ctx_len + B i .. + B. A padding block's
    intervals are empty. The mask_mod and the BlockMask's tile tables both come from these."""
    limit, block_id = _block_tables(anchors, valid, context_inclusive)
    b, n = limit.shape
    slot = torch.arange(block_size, device=limit.device)                              # [B]
    w = ctx_len + (n + 1) * block_size if sliding_window is None else int(sliding_window)  # no window: wider than all
    ctx_hi = limit[..., None].expand(b, n, block_size)                                # [b, N, B]
    ctx_lo = (limit[..., None] - int(context_inclusive) + slot - w + 1).clamp_min(0)
    own_base = ctx_len + block_size * block_id.clamp_min(0)[..., None]                 # [b, N, 1]
    own_lo = own_base + (slot - w + 1).clamp_min(0)
    own_hi = torch.where((block_id >= 0)[..., None], own_base + (slot + w).clamp_max(block_size), own_lo)
    return ctx_lo, ctx_hi, own_lo, own_hi


def make_mask_mod(anchors: Tensor, valid: Tensor, ctx_len: int, block_size: int, context_inclusive: bool = False,
                  sliding_window: Optional[int] = None):
    """flex_attention ``mask_mod(b, h, q_idx, kv_idx)`` implementing the same rule as :func:`dense_mask`: a key is
    visible iff it lies in one of the query row's two intervals (``_row_intervals``, int32 [b, Q] each).

    It captures those four tensors and nothing else: no Python number (the context length, the block size, the
    window), so under dynamic shapes no captured value becomes a symbolic scalar, which flex's FLASH backend
    (FlashAttention-4's kernels) refuses to compile ("captures a dynamic scalar"); no division either."""
    _check_window(sliding_window)
    return _interval_mask_mod(_row_intervals(anchors, valid, ctx_len, block_size, context_inclusive, sliding_window))


def _interval_mask_mod(intervals: tuple[Tensor, Tensor, Tensor, Tensor]):
    """The mask_mod of ``_row_intervals``' four [b, N, B] tensors (see :func:`make_mask_mod`)."""
    b = intervals[0].shape[0]
    c_lo, c_hi, o_lo, o_hi = (t.reshape(b, -1).to(torch.int32).contiguous() for t in intervals)

    def dflash_mask_mod(b, h, q_idx, kv_idx):
        in_ctx = (kv_idx >= c_lo[b, q_idx]) & (kv_idx < c_hi[b, q_idx])
        in_own_block = (kv_idx >= o_lo[b, q_idx]) & (kv_idx < o_hi[b, q_idx])
        return in_ctx | in_own_block

    return dflash_mask_mod


def visible_pairs(anchors: Tensor, valid: Tensor, block_size: int, sliding_window: Optional[int] = None) -> Tensor:
    """The number of True entries of ``dense_mask(anchors, valid, ., block_size, sliding_window=...)`` (fp64
    scalar on the anchors' device, no host sync): B * (a + B) per valid block; with a window W >= B, slot s sees
    min(a, W - 1 - s) context keys and its whole block. The drafter's attention FLOPs (telemetry/flops.py)."""
    B = int(block_size)
    if sliding_window is None:
        return (B * (anchors + B) * valid).sum(dtype=torch.float64)
    if int(sliding_window) < B:
        raise ValueError(f"sliding_window={sliding_window} < block_size={B}")
    slot = torch.arange(B, device=anchors.device)
    ctx = torch.minimum(anchors.long()[:, :, None], int(sliding_window) - 1 - slot)
    return ((ctx + B) * valid[:, :, None]).sum(dtype=torch.float64)


def layer_masks(layer_types: Optional[Sequence[str]], build: Callable[[Optional[int]], Any],
                sliding_window: Optional[int]) -> Any:
    """The mask argument of ``DFlashDrafter.forward`` for a drafter with these ``layer_types``: one mask
    (``build(None)``) when every layer is full attention, else ``{layer_type: mask}`` with
    ``build(sliding_window)`` for ``sliding_attention``. ``build(w)`` is e.g.
    ``lambda w: flex_block_mask(anchors, valid, ctx_len, B, sliding_window=w)``."""
    kinds = set(layer_types or ["full_attention"])
    if kinds == {"full_attention"}:
        return build(None)
    out = {}
    if "full_attention" in kinds:
        out["full_attention"] = build(None)
    if "sliding_attention" in kinds:
        out["sliding_attention"] = build(sliding_window)
    return out


TILE = 128
"""The BlockMask's tile (torch's default sparse block size; the flex kernels' tiles divide it)."""


def tile_tables(anchors: Tensor, valid: Tensor, ctx_len: int, block_size: int, context_inclusive: bool = False,
                tile: int = TILE, sliding_window: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """(partial, full) int8 [b, 1, Q tiles, K tiles] of the mask, from each query row's two key intervals
    (``_row_intervals``) alone: what ``create_block_mask`` computes by evaluating the mask on all Q x K pairs, here
    from one [b, Q, K tiles] count. A tile is full when every row of it sees all ``tile`` keys of it (rows and keys
    past Q and K, the padding to whole tiles, see nothing), partial when some row sees some."""
    _check_window(sliding_window)
    return _tiles_from_intervals(_row_intervals(anchors, valid, ctx_len, block_size, context_inclusive,
                                                sliding_window), ctx_len, tile)


def _tiles_from_intervals(intervals: tuple[Tensor, Tensor, Tensor, Tensor], ctx_len: int,
                          tile: int = TILE) -> tuple[Tensor, Tensor]:
    """:func:`tile_tables` of ``_row_intervals``' four [b, N, B] tensors."""
    ctx_lo, ctx_hi, own_lo, own_hi = intervals
    b, n, block_size = ctx_lo.shape
    q_len, k_len = n * block_size, ctx_len + n * block_size
    q_tiles, k_tiles = -(-q_len // tile), -(-k_len // tile)
    dev = ctx_lo.device
    k0 = torch.arange(k_tiles, device=dev) * tile                                     # [KT]
    k1 = torch.clamp(k0 + tile, max=k_len)

    def overlap(lo: Tensor, hi: Tensor) -> Tensor:                                    # [b, Q, KT] keys of [lo, hi)
        lo, hi = lo.reshape(b, q_len, 1), hi.reshape(b, q_len, 1)
        return (torch.minimum(hi, k1) - torch.maximum(lo, k0)).clamp_min(0)

    seen = overlap(ctx_lo, ctx_hi) + overlap(own_lo, own_hi)                          # the intervals are disjoint
    rows = seen.new_zeros(b, q_tiles * tile, k_tiles)                                 # padding rows see nothing
    rows[:, :q_len] = seen
    rows = rows.view(b, q_tiles, tile, k_tiles)
    full = rows.amin(2) == tile
    partial = (rows.amax(2) > 0) & ~full
    return partial[:, None].to(torch.int8), full[:, None].to(torch.int8)


def block_mask_from_tables(partial: Tensor, full: Tensor, mask_mod, seq_lengths: tuple[int, int],
                           tile: int = TILE) -> BlockMask:
    """The BlockMask of the dense (partial, full) tile tables [b, 1, Q tiles, K tiles]: each table ordered per
    query tile (the forward's) and, from its transpose, per key tile (the backward's). torch's own
    ``_create_sparse_block_from_block_mask`` gets the same tensors (tested) but rebuilds the dense tables for the
    key side under two levels of vmap, host time a step waits for before its first kernel
    (docs/benchmarks.md#long-context-mask)."""
    kv, full_kv = _dense_to_ordered(partial), _dense_to_ordered(full)
    q, full_q = _dense_to_ordered(partial.transpose(-2, -1)), _dense_to_ordered(full.transpose(-2, -1))
    return BlockMask(seq_lengths=seq_lengths, kv_num_blocks=kv[0], kv_indices=kv[1], full_kv_num_blocks=full_kv[0],
                     full_kv_indices=full_kv[1], q_num_blocks=q[0], q_indices=q[1], full_q_num_blocks=full_q[0],
                     full_q_indices=full_q[1], BLOCK_SIZE=(tile, tile), mask_mod=mask_mod)


def flex_block_mask(anchors: Tensor, valid: Tensor, ctx_len: int, block_size: int, compile: bool = True,
                    context_inclusive: bool = False, dynamic: bool = False,
                    sliding_window: Optional[int] = None, from_tables: bool = True) -> BlockMask:
    """BlockMask for one step (H=None: shared by all heads), built once and reused by every layer.

    The mask (full attention, or ``sliding_window``'s) comes from ``tile_tables``: the same BlockMask as torch's
    ``create_block_mask`` (tested) from the per-block intervals, without evaluating the mask on every Q x K pair
    (a 640-key mask on a 2-core CPU: 624 -> 9 ms per build; on an H200 the compiled builder's kernel was 1.7 ms of a
    3K-context step and 14 ms of a 32K one; the steps run 0-1.6% faster from the tables, measured:
    docs/benchmarks.md#long-context-mask).

    ``from_tables=False`` (benchmarks compare the two) goes through ``create_block_mask``: with ``compile=True`` on
    accelerators the module-level compiled builder, so the [b, Q, K] mask is never materialised (``dynamic=True``:
    its dynamic-shape graph, so new (b, S_pad) shapes do not recompile). On CPU nothing is compiled even with
    compile=True: inductor's CPU backend miscompiles this reduction in torch 2.13 (C++ VecMask type error).
    ``mask_build_calls`` records which path ran.
    """
    b, n = anchors.shape
    q_len = n * block_size
    _check_window(sliding_window)
    intervals = _row_intervals(anchors, valid, ctx_len, block_size, context_inclusive, sliding_window)
    mask_mod = _interval_mask_mod(intervals)                        # the tile tables and the mask_mod: one source
    if from_tables and _dense_to_ordered is not None:
        mask_build_calls["tables"] += 1
        partial, full = _tiles_from_intervals(intervals, ctx_len)
        return block_mask_from_tables(partial, full, mask_mod, (q_len, ctx_len + q_len))
    if compile and anchors.device.type != "cpu":
        mask_build_calls["compiled"] += 1
        builder = _create_block_mask_compiled_dynamic if dynamic else _create_block_mask_compiled
    else:
        mask_build_calls["eager"] += 1
        builder = create_block_mask
    return builder(mask_mod, b, None, q_len, ctx_len + q_len, device=anchors.device)
