"""Anchor sampling and block construction for one drafter step.

A block is ``[input_ids[a], MASK, ..., MASK]`` (B tokens) at positions ``a, a+1, ..., a+B-1``. Slot k >= 1
predicts ``input_ids[a+k]`` at its own position (no shift: the block is denoised in place, as at inference
where the drafter proposes tokens a+1..a+B-1 after the verified token a). Slot 0 is the known anchor token
and never carries a loss.

With the target's own labels (``drafter.loss.labels=target``) slot k is supervised with the target's greedy next
token after position a+k-1 given the true prefix, ``target_ids[a+k-1]``, in place of ``input_ids[a+k]`` (the same
slots carry a loss: those whose token a+k is supervised). ``drafter.loss.kind=kl`` also gathers the target's
top-k distribution there (``soft_ids`` / ``soft_probs``).

Shapes are static (N blocks per sample, context padded to a multiple of ``ctx_bucket``) so compiled kernels
see few distinct shapes; samples with fewer candidate anchors get padding blocks (valid=False, anchor 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

__all__ = ["DrafterBatch", "sample_anchors", "make_batch", "split_anchors", "target_labels", "IGNORE_INDEX"]

IGNORE_INDEX = -100


@dataclass
class DrafterBatch:
    """One drafter step; all tensors on the features' device. b samples, N blocks of B slots, Q = N*B."""

    features: Tensor         # [b, S_pad, n*H] target features, zero past each sample's length
    ctx_positions: Tensor    # [b, S_pad] long, 0..S_pad-1 (RoPE positions of the context keys)
    block_ids: Tensor        # [b, Q] long: anchor token then MASK ids (all MASK for padding blocks)
    block_positions: Tensor  # [b, Q] long: a, a+1, ..., a+B-1 per block (0..B-1 for padding blocks)
    labels: Tensor           # [b, Q] long, IGNORE_INDEX (-100) where there is no loss
    block_tokens: Tensor     # [b, Q] long: the sequence's token at each slot, whatever the loss mask (teacher forcing)
    anchors: Tensor          # [b, N] long, sorted ascending among valid blocks; 0 for padding blocks
    valid: Tensor            # [b, N] bool
    num_samples: int         # b
    num_tokens: int          # real (unpadded) context tokens in the step, sum of sample lengths
    src: Optional[int] = None  # the target rank whose message this is (None: a dry step); loss_on_target asks it
    index: int = -1            # that message's plan index
    soft_ids: Optional[Tensor] = None    # [b, Q, k] long: the target's top-k next tokens at each slot (kind=kl)
    soft_probs: Optional[Tensor] = None  # [b, Q, k] fp32: their probabilities, renormalised over the k

    @property
    def soft(self) -> Optional[tuple[Tensor, Tensor]]:
        """(soft_ids, soft_probs), or None without a target distribution."""
        return None if self.soft_ids is None else (self.soft_ids, self.soft_probs)

    @property
    def ctx_len(self) -> int:
        return self.features.shape[1]


def split_anchors(batch: DrafterBatch, groups: int) -> list[DrafterBatch]:
    """``groups`` batches of N/groups consecutive blocks each, sharing the context (drafter.tuning.micro_batches). A block
    attends to the context before its anchor and to its own block only, so each block's output is the same as in
    the whole batch; only the context's projections run once per group."""
    if groups == 1:
        return [batch]
    b, n = batch.anchors.shape
    if n % groups:
        raise ValueError(f"{n} blocks per sample do not split into {groups} groups")
    nb = n // groups
    q = batch.block_ids.shape[1] // n * nb
    out = []
    for i in range(groups):
        rows, blocks = slice(i * q, (i + 1) * q), slice(i * nb, (i + 1) * nb)
        part = {name: getattr(batch, name)[:, rows].contiguous() for name in ("block_ids", "block_positions", "labels",
                                                                      "block_tokens")}
        if batch.soft_ids is not None:
            part.update({name: getattr(batch, name)[:, rows].contiguous() for name in ("soft_ids", "soft_probs")})
        part.update({name: getattr(batch, name)[:, blocks].contiguous() for name in ("anchors", "valid")})
        out.append(DrafterBatch(features=batch.features, ctx_positions=batch.ctx_positions, **part,
                                num_samples=batch.num_samples,
                                num_tokens=batch.num_tokens, src=batch.src, index=batch.index))
    return out


def target_labels(loss, msg, tokens: int, dry_ids: Optional[Tensor] = None) -> dict:
    """``make_batch``'s target_ids / target_probs for a step under the loss settings ``loss`` (model/spec.LossSpec):
    nothing with the data's labels; else the message's (``msg`` None: an empty batch of ``tokens`` = 0 rows, or a
    dry step whose ``dry_ids`` [T] stand for the target's tokens, with a uniform distribution for kind=kl)."""
    if loss.labels != "target":
        return {}
    kl = loss.kind == "kl"
    k = loss.kl_top_k if kl else 1
    if msg is not None:
        if msg.target_ids is None or (kl and msg.target_probs is None) or msg.target_ids.shape[1] != k:
            raise RuntimeError(f"message {msg.index} from rank {msg.src} carries no target labels of {k} token(s) "
                               f"per position, but drafter.loss.labels=target, kind={loss.kind}")
        return {"target_ids": msg.target_ids, "target_probs": msg.target_probs}
    ids = torch.stack([dry_ids.roll(j) for j in range(k)], 1) if dry_ids is not None else \
        torch.zeros(tokens, k, dtype=torch.long)
    probs = torch.full(ids.shape, 1.0 / k, device=ids.device) if kl else None
    return {"target_ids": ids, "target_probs": probs}


def to_device_async(t: Tensor, dev: torch.device) -> Tensor:
    """Host tensor to ``dev`` without a host sync: a plain CUDA copy from pageable memory synchronizes the
    stream (the host then waits for the whole queued step, and for the receive the step waits on)."""
    if dev.type != "cuda" or t.device == dev:
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


def sample_anchors(loss_mask: Tensor, num_anchors: int, generator: Optional[torch.Generator],
                   keys: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Pick up to ``num_anchors`` anchors a with loss_mask[a] and loss_mask[a+1], uniformly without replacement.

    Uses top-k of i.i.d. uniform keys over the candidates (a uniform random subset), which keeps every shape
    static and needs no host sync. Returns anchors [N] long (ascending, padded with 0) and valid [N] bool;
    the number of valid anchors is min(#candidates, N). Random keys are drawn on the generator's device so a
    CPU generator stays reproducible whatever device the mask lives on; ``keys`` [S-1] (already on the mask's
    device) are those draws made by the caller.
    """
    dev = loss_mask.device
    n = int(num_anchors)
    s = loss_mask.numel()
    anchors = torch.zeros(n, dtype=torch.long, device=dev)
    valid = torch.zeros(n, dtype=torch.bool, device=dev)
    if s < 2:
        return anchors, valid
    lm = loss_mask.bool()
    cand = lm[:-1] & lm[1:]                                                      # [S-1]
    if keys is None:
        gen_dev = generator.device if generator is not None else dev
        keys = torch.rand(s - 1, generator=generator, device=gen_dev).to(dev)
    keys = keys.masked_fill(~cand, -1.0)                                         # non-candidates rank last
    k = min(n, s - 1)
    top, idx = keys.topk(k)
    pos = torch.where(top >= 0, idx, torch.full_like(idx, s)).sort().values     # invalid (= s) sort last
    ok = pos < s
    anchors[:k] = torch.where(ok, pos, torch.zeros_like(pos))
    valid[:k] = ok
    return anchors, valid


def make_batch(input_ids: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, features: Tensor, *, num_anchors: int,
               block_size: int, mask_token_id: int, ctx_bucket: int, generator: Optional[torch.Generator],
               target_ids: Optional[Tensor] = None, target_probs: Optional[Tensor] = None) -> DrafterBatch:
    """Build one step from packed samples.

    input_ids [T] long, loss_mask [T] bool (True on supervised tokens), cu_seqlens [b+1] long (sample i is
    rows cu[i]:cu[i+1]), features [T, n*H]. Context is padded to S_pad = ceil(max_len / ctx_bucket) * ctx_bucket.
    One host read of cu_seqlens; the per-sample loop only copies slices, everything else is batched. No host
    sync on CUDA: the anchors' random keys (drawn on a CPU generator, as on CPU) and the lengths reach the
    device in one pinned, non-blocking copy each.
    ``target_ids`` [T, k] (column 0 the target's greedy next token at each position): the labels are the
    target's (module docstring); with ``target_probs`` [T, k] the batch carries the top-k distribution per slot.
    """
    dev = features.device
    bsz = block_size
    cu = [int(c) for c in cu_seqlens.tolist()]
    b = len(cu) - 1
    if b < 1:
        raise ValueError("make_batch needs at least one sample (cu_seqlens has fewer than 2 entries)")
    lens = [cu[i + 1] - cu[i] for i in range(b)]
    if min(lens) < 0 or cu[-1] > features.shape[0]:
        raise ValueError(f"cu_seqlens {cu} inconsistent with {features.shape[0]} feature rows")
    s_pad = max(1, math.ceil(max(lens) / ctx_bucket)) * ctx_bucket
    input_ids = input_ids.to(dev)
    loss_mask = loss_mask.to(dev).bool()

    feats = features.new_zeros(b, s_pad, features.shape[-1])
    nxt = None if target_ids is None else _per_sample(target_ids.to(dev), cu, s_pad)              # [b, s_pad, k]
    nxt_p = None if target_probs is None else _per_sample(target_probs.to(dev).float(), cu, s_pad)
    ids = torch.zeros(b, s_pad, dtype=torch.long, device=dev)
    sup = torch.zeros(b, s_pad, dtype=torch.bool, device=dev)
    anchors = torch.empty(b, num_anchors, dtype=torch.long, device=dev)
    valid = torch.empty(b, num_anchors, dtype=torch.bool, device=dev)
    keys = [None] * b
    if generator is not None and generator.device.type == "cpu":
        # the same draws, in the same order, as sample_anchors would make: one copy instead of one sync per sample
        drawn = [torch.rand(max(n - 1, 0), generator=generator) for n in lens]
        keys = list(to_device_async(torch.cat(drawn), dev).split([d.numel() for d in drawn]))
    for i, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        n_i = hi - lo
        feats[i, :n_i] = features[lo:hi]
        ids[i, :n_i] = input_ids[lo:hi]
        sup[i, :n_i] = loss_mask[lo:hi]
        anchors[i], valid[i] = sample_anchors(loss_mask[lo:hi], num_anchors, generator, keys[i])

    offs = torch.arange(bsz, device=dev)
    pos = anchors[:, :, None] + offs                                             # [b, N, B]
    flat = pos.clamp(max=s_pad - 1).reshape(b, -1)
    tok = ids.gather(1, flat).view_as(pos)
    tok_sup = sup.gather(1, flat).view_as(pos)
    in_sample = pos < to_device_async(torch.tensor(lens), dev)[:, None, None]
    has_label = in_sample & tok_sup & valid[:, :, None] & (offs >= 1)
    soft_ids = soft_probs = None
    target = tok  # what each slot is supervised with; block_tokens stay the sequence's (teacher forcing)
    if nxt is not None:
        # slot k >= 1 at position a+k: the target's prediction made at a+k-1 (slot 0 is never supervised)
        prev = (flat - 1).clamp(min=0)[:, :, None].expand(-1, -1, nxt.shape[-1])
        tops = nxt.gather(1, prev).view(*pos.shape, -1)                                  # [b, N, B, k]
        target = torch.where(offs >= 1, tops[..., 0], tok)
        if nxt_p is not None:
            soft_ids = tops.reshape(b, -1, tops.shape[-1])
            soft_probs = nxt_p.gather(1, prev).reshape(b, -1, tops.shape[-1])
    labels = torch.where(has_label, target, torch.full_like(tok, IGNORE_INDEX))

    block_ids = torch.full_like(tok, int(mask_token_id))
    block_ids[:, :, 0] = torch.where(valid, tok[:, :, 0], block_ids[:, :, 0])

    return DrafterBatch(
        features=feats,
        ctx_positions=torch.arange(s_pad, device=dev).expand(b, s_pad).contiguous(),
        block_ids=block_ids.reshape(b, -1),
        block_positions=pos.reshape(b, -1),
        labels=labels.reshape(b, -1),
        block_tokens=tok.reshape(b, -1),
        anchors=anchors,
        valid=valid,
        num_samples=b,
        num_tokens=cu[-1] - cu[0],
        soft_ids=soft_ids,
        soft_probs=soft_probs,
    )


def _per_sample(rows: Tensor, cu: list, s_pad: int) -> Tensor:
    """Packed per-token rows [T, k] -> [b, s_pad, k], zero past each sample's length."""
    out = rows.new_zeros(len(cu) - 1, s_pad, rows.shape[-1])
    for i, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        out[i, :hi - lo] = rows[lo:hi]
    return out
