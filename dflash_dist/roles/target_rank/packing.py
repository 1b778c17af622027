"""Packed rows of the target capture: the samples of a message concatenated into one row [1, T] without padding,
positions restarting at each sample, and document-causal attention (a token sees the earlier tokens of its own
sample only) by a compiled ``flex_attention`` with a BlockMask, registered with transformers' AttentionInterface as
``PACKED_ATTN``. The row gives the padded rows' features exactly: sliding-window layers get one more BlockMask per
window, attention sinks renormalise flex's output with the sink logit, and the row is padded with one more sample
that nothing sees, so the compiled kernels meet few lengths and never a one-block row. flex never runs uncompiled
(its eager path materialises the [h, T, T] score matrix); the masks are built by a compiled builder for the same
reason.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

try:  # torch >= 2.9
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover
    AuxRequest = None

from dflash_dist.model.lazy_compile import lazy_compile


PACKED_ATTN = "packed_document_causal"


"""The attention implementation the packed capture registers with transformers' AttentionInterface. (transformers
matches names by substring: one containing "flash", "flex_attention" or "sdpa" would get their checks.)"""


# Module-level compiled kernels, shared by every capture. flex_attention must never run uncompiled (its eager path
# materialises the [h, T, T] score matrix), hence fullgraph (which also turns dynamo's recompile limit into an
# error instead of an eager fallback). CUDA: dynamic shapes, one kernel for every packed length T. CPU: static,
# one kernel per row length (``packed_row_tokens`` keeps those few): inductor's C++ flex template compiled for dynamic
# lengths fails to build once rows are seen on both sides of 128 tokens (torch 2.13).
_flex_static = lazy_compile(flex_attention, fullgraph=True, dynamic=False)


_flex_dynamic = lazy_compile(flex_attention, fullgraph=True, dynamic=True)


# The block mask is built from the document ids by a compiled builder: the eager one evaluates the mask_mod on
# every (q, kv) pair, a dense [T, T] mask.
_block_mask_static = lazy_compile(create_block_mask, dynamic=False)


_block_mask_dynamic = lazy_compile(create_block_mask, dynamic=True)


def packed_row_tokens(total: int, device_type: str) -> int:
    """Tokens of the packed row for ``total`` real tokens; the pad is one more sample that nothing else sees.
    CPU: a power of two >= 256, so the static CPU kernels see a few lengths only, all on the same side of 128.
    CUDA: at least 256, so the dynamic kernels never meet a row of one 128-token mask block: dynamic shapes
    specialise a size of 1, and the compile of the flex kernel for that block mask failed in inductor (2x H200, torch
    2.11: the builtin corpus's short samples, a 4-sample message under 128 tokens). Longer rows are
    not padded."""
    if device_type == "cpu":
        return max(256, 1 << (total - 1).bit_length())
    return max(256, total)


packed_stats = {"flex_calls": 0, "block_masks": 0}


"""Calls of the packed attention outside compiled layers (inside them the call is part of the layer's graph)
and block masks built; the capture checks the first against the attention layers that ran."""


WINDOW_MASKS_KWARG = "packed_window_masks"
"""Forward kwarg (passed down to every attention call) with the packed row's {sliding_window: BlockMask}."""


def packed_flex_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface function of the packed capture: query [1, h, T, d], key/value
    [1, h_kv, T, d], ``attention_mask`` the capture's document-causal BlockMask. Returns ([1, T, h, d], None).
    ``sliding_window``: the window's BlockMask from ``packed_window_masks``; ``s_aux`` (attention sinks, one
    logit per head): the output renormalised by ``exp(lse - logsumexp([lse, sink]))``."""
    if not isinstance(attention_mask, BlockMask):
        raise RuntimeError(f"attention {PACKED_ATTN!r} needs the packed capture's BlockMask as attention_mask, got "
                           f"{type(attention_mask).__name__}: only FeatureCapture(packing=True) may select it")
    if kwargs.get("softcap") is not None:
        raise RuntimeError(f"attention {PACKED_ATTN!r} does not support softcapping")
    mask = attention_mask
    window = kwargs.get("sliding_window")
    if window is not None:
        mask = (kwargs.get(WINDOW_MASKS_KWARG) or {}).get(int(window))
        if mask is None:
            raise RuntimeError(f"attention {PACKED_ATTN!r}: no packed block mask for sliding window {window} (the "
                               "capture builds one per window it finds in the model)")
    if not torch.compiler.is_compiling():
        packed_stats["flex_calls"] += 1
    flex = _flex_static if query.device.type == "cpu" else _flex_dynamic
    sinks = kwargs.get("s_aux")
    gqa = query.shape[1] != key.shape[1]
    t = key.shape[2]
    if sinks is None:
        out = flex(query, key, value, block_mask=mask, scale=scaling, enable_gqa=gqa)
    elif mask.seq_lengths[1] == t + 1:
        # the sink as one more key column that every query sees, with the sink logit as its score and a zero
        # value: softmax over [scores | sink] exactly (CPU: its compiled flex cannot return the log-sum-exp)
        pad = key.new_zeros(key.shape[0], key.shape[1], 1, key.shape[3])
        sink = sinks.to(query.dtype)

        def sink_score(score, b, h, q_idx, kv_idx):
            return torch.where(kv_idx == t, sink[h].to(score.dtype), score)
        out = flex(query, torch.cat([key, pad], 2), torch.cat([value, pad], 2), score_mod=sink_score,
                   block_mask=mask, scale=scaling, enable_gqa=gqa)
    else:
        if AuxRequest is not None:
            out, aux = flex(query, key, value, block_mask=mask, scale=scaling, enable_gqa=gqa,
                            return_aux=AuxRequest(lse=True))
            lse = aux.lse
        else:  # pragma: no cover - torch < 2.9
            out, lse = flex(query, key, value, block_mask=mask, scale=scaling, enable_gqa=gqa, return_lse=True)
        lse = lse.float().unsqueeze(-1)                                   # [1, h, T, 1], natural log
        sink = sinks.float().view(1, -1, 1, 1).expand_as(lse)
        out = (out.float() * torch.exp(lse - torch.logaddexp(lse, sink))).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def register_packed_attention() -> None:
    # Only the attention function is registered, no mask function. The capture passes its BlockMask as the
    # attention_mask of the forward, and transformers' create_causal_mask returns a prepared 4-D mask (a
    # BlockMask is [B, H, T, T]) as it is: HF builds no mask of its own, dense or block.
    from transformers import AttentionInterface
    AttentionInterface.register(PACKED_ATTN, packed_flex_attention)


def document_causal_block_mask(lengths: torch.Tensor, total: int, device, windows: tuple = (),
                               sink_column: bool = False):
    """(BlockMask: a token sees the earlier-or-same tokens of its own sample, per-sample positions [T]) for the
    samples of ``lengths`` concatenated into one row of ``total`` tokens. With ``windows`` or ``sink_column``: a
    third element {window: BlockMask that also needs ``q - kv < window``} (transformers' sliding-window mask, per
    sample). ``sink_column``: every mask has one more key column (index ``total``) that every query sees: the
    attention sink's column (see ``packed_flex_attention``)."""
    lengths = lengths.to(device)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths, output_size=total)
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(total, device=device) - starts[doc]
    kv_len = total + 1 if sink_column else total
    doc_kv = torch.cat([doc, torch.full((1,), -1, device=device, dtype=doc.dtype)]) if sink_column else doc

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc_kv[kv_idx]) & (q_idx >= kv_idx)

    def with_sink(fn):
        if not sink_column:
            return fn
        return lambda b, h, q_idx, kv_idx: fn(b, h, q_idx, kv_idx) | (kv_idx == total)

    builder = _block_mask_static if torch.device(device).type == "cpu" else _block_mask_dynamic
    packed_stats["block_masks"] += 1
    full = builder(with_sink(document_causal), None, None, total, kv_len, device=device)
    if not windows and not sink_column:
        return full, positions
    by_window = {}
    for w in windows:
        w_t = torch.tensor(int(w), device=device)

        def document_window(b, h, q_idx, kv_idx, w_t=w_t):
            return (doc[q_idx] == doc_kv[kv_idx]) & (q_idx >= kv_idx) & (q_idx - kv_idx < w_t)
        packed_stats["block_masks"] += 1
        by_window[int(w)] = builder(with_sink(document_window), None, None, total, kv_len, device=device)
    return full, positions, by_window
