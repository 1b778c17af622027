"""A message's samples as the target's forward takes them (padded rows, or one packed row)."""

from __future__ import annotations

import torch

__all__ = ["pad_batch"]


def pad_batch(samples, device, packed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward ids on ``device`` (right-padded [b, S]; ``packed``: the samples concatenated, [1, T]), lengths [b],
    packed ids [T] and packed loss mask [T]."""
    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.long)
    ids = None if packed else torch.zeros(len(samples), int(lengths.max()), dtype=torch.long)
    packed_ids, packed_mask = [], []
    for i, s in enumerate(samples):
        t = torch.as_tensor(s.input_ids, dtype=torch.long)
        if ids is not None:
            ids[i, :len(t)] = t
        packed_ids.append(t)
        packed_mask.append(torch.as_tensor(s.loss_mask, dtype=torch.bool))
    packed_ids = torch.cat(packed_ids)
    ids = packed_ids[None] if packed else ids
    return ids.to(device), lengths, packed_ids, torch.cat(packed_mask)
