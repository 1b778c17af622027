"""How far an FP8 target's captured features are from its bf16 reference's: cosine per captured layer."""

from __future__ import annotations

import torch


def layer_cosines(ref: torch.Tensor, test: torch.Tensor, n_layers: int) -> list[dict]:
    """Per captured layer of features [T, n_layers*H] (the capture's layout: layers side by side), the cosine of
    each token's feature vector against the reference's: {mean, min} over the T tokens, in fp32."""
    if ref.shape != test.shape:
        raise ValueError(f"feature shapes differ: {tuple(ref.shape)} vs {tuple(test.shape)}")
    out = []
    for a, b in zip(ref.float().chunk(n_layers, dim=-1), test.float().chunk(n_layers, dim=-1)):
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        out.append({"mean": float(cos.mean()), "min": float(cos.min())})
    return out
