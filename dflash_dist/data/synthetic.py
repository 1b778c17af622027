"""Synthetic token data for throughput work: ``data.source=synthetic:<mean_len>:<num_samples>[:<min>-<max>]``.

Random token ids with lengths drawn around a mean (uniform in [min, max], default mean/2 .. 3*mean/2),
the first ~30% of each sample a "prompt" (no loss) and the rest a supervised "response". The models see
realistic shapes; the numbers measure speed, not learning.
"""

from __future__ import annotations

import torch

from dflash_dist.data.tokenize import TokenizedDataset


def parse_spec(source: str) -> tuple[int, int, int, int]:
    parts = source.split(":")
    if parts[0] != "synthetic" or len(parts) not in (3, 4):
        raise ValueError(f"data.source={source!r}: expected synthetic:<mean_len>:<num_samples>[:<min>-<max>]")
    mean, n = int(parts[1]), int(parts[2])
    lo, hi = (mean // 2, mean * 3 // 2)
    if len(parts) == 4:
        lo, hi = (int(x) for x in parts[3].split("-"))
    if not (8 <= lo <= hi and n >= 1):
        raise ValueError(f"data.source={source!r}: need 8 <= min <= max and num_samples >= 1")
    return mean, n, lo, hi


def synthetic_dataset(source: str, vocab_size: int, max_length: int, seed: int = 0) -> TokenizedDataset:
    _, n, lo, hi = parse_spec(source)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).clamp_max(max_length)
    total = int(lengths.sum())
    tokens = torch.randint(0, min(vocab_size, 1 << 31), (total,), generator=g, dtype=torch.int64)
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    pos = torch.arange(total) - torch.repeat_interleave(offsets[:-1], lengths)
    prompt = (lengths * 3 // 10).clamp_min(1)
    loss_mask = pos >= torch.repeat_interleave(prompt, lengths)
    return TokenizedDataset(tokens.to(torch.int32), loss_mask, offsets, meta={"source": source})
