"""What crosses the wire between a target and a drafter: the ``Message`` (a micro-batch of whole samples) and its
end-of-stream marker, the fixed-size header's slots, the int64 meta tensor's layout, and the stream's errors.
``comm/transport.py`` sends and receives them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

MAGIC = 0x44464C53  # "DFLS"
HEADER_LEN = 19
KIND_DATA, KIND_END, KIND_ERROR = 1, 2, 3

# header slots
H_MAGIC, H_KIND, H_INDEX, H_NSAMPLES, H_NTOKENS, H_WIDTH, H_DTYPE, H_METALEN, H_SRC, H_ERRLEN = range(10)
H_STATS = 10  # 10..16: sender statistics (cumulative busy us, wait us, tokens, samples, wall us, MFLOP,
#              idle-work us: the in-training evaluation run while waiting)
N_STATS = 7
H_LABEL_K, H_LABEL_PROBS = 17, 18  # the target's labels: k ids per token (0: none), whether probabilities follow

DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


class TransportError(RuntimeError):
    """The stream broke: wrong header, a peer that stopped answering, or a peer that reported an error."""


class RemoteError(TransportError):
    """A peer rank failed and said why (an ERROR message)."""

    def __init__(self, src: int, text: str):
        super().__init__(f"rank {src} failed: {text}")
        self.src, self.text = src, text


@dataclass
class Message:
    """One micro-batch of whole samples. Made with ``Message.build`` (the target's capture, the receiver and the
    drafter's measurement alike)."""
    index: int                  # plan index k of this micro-batch
    sample_ids: torch.Tensor    # [n] int64
    cu_seqlens: torch.Tensor    # [n+1] int64
    input_ids: torch.Tensor     # [T] int64
    loss_mask: torch.Tensor     # [T] bool
    features: torch.Tensor      # [T, F]
    src: int = -1
    sender_stats: list = field(default_factory=list)
    target_ids: Optional[torch.Tensor] = None    # [T, k] int64: the target's k likeliest next tokens, greedy first
    target_probs: Optional[torch.Tensor] = None  # [T, k] fp32: their probabilities renormalised over the k

    @classmethod
    def build(cls, index: int, sample_ids, cu_seqlens: torch.Tensor, input_ids: torch.Tensor,
              loss_mask: torch.Tensor, features: torch.Tensor, src: int = -1, sender_stats=(),
              target_ids: Optional[torch.Tensor] = None, target_probs: Optional[torch.Tensor] = None) -> "Message":
        """The one constructor: sample ids (a list or a tensor) and cu_seqlens as int64 tensors, the shapes
        checked here, so a malformed message fails where it is made."""
        msg = cls(int(index), torch.as_tensor(sample_ids, dtype=torch.long), cu_seqlens.long(), input_ids,
                  loss_mask, features, src, list(sender_stats), target_ids, target_probs)
        msg.validate()
        return msg

    @staticmethod
    def cu_of(lengths: torch.Tensor) -> torch.Tensor:
        """cu_seqlens [n+1] (int64, host) of samples of ``lengths`` [n]."""
        return torch.cat([torch.zeros(1, dtype=torch.long), lengths.to("cpu", torch.long).cumsum(0)])

    @property
    def num_samples(self) -> int:
        return int(self.sample_ids.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def label_k(self) -> int:
        return 0 if self.target_ids is None else int(self.target_ids.shape[1])

    def validate(self) -> None:
        n, t = self.sample_ids.numel(), self.input_ids.numel()
        if self.cu_seqlens.numel() != n + 1 or self.loss_mask.numel() != t or self.features.shape[0] != t:
            raise TransportError(f"message {self.index}: inconsistent shapes")
        ids, probs = self.target_ids, self.target_probs
        if (ids is not None and (ids.dim() != 2 or ids.shape[0] != t or ids.shape[1] < 1)) or (
                probs is not None and (ids is None or probs.shape != ids.shape)):
            raise TransportError(f"message {self.index}: target labels of inconsistent shape")


@dataclass
class EndOfStream:
    src: int
    sender_stats: list = field(default_factory=list)


def meta_len(n: int, t: int, label_k: int = 0) -> int:
    """Elements of the meta tensor: sample ids, cu_seqlens, token ids, loss mask, the target's label ids."""
    return 2 * n + 1 + 2 * t + t * label_k


def pack_meta(sample_ids, cu_seqlens, input_ids, loss_mask, target_ids=None) -> torch.Tensor:
    labels = [] if target_ids is None else [target_ids.to(input_ids.device).long().reshape(-1)]
    return torch.cat([sample_ids.long(), cu_seqlens.long(), input_ids.long(), loss_mask.long()] + labels)


def unpack_meta(meta: torch.Tensor, n: int, t: int):
    """(sample ids, cu_seqlens, token ids, loss mask); the target's label ids after them: ``unpack_labels``."""
    sample_ids = meta[:n]
    cu = meta[n:2 * n + 1]
    ids = meta[2 * n + 1:2 * n + 1 + t]
    mask = meta[2 * n + 1 + t:2 * n + 1 + 2 * t].bool()
    return sample_ids, cu, ids, mask


def unpack_labels(meta: torch.Tensor, n: int, t: int, label_k: int) -> Optional[torch.Tensor]:
    """The target's label ids [t, label_k] at the end of the meta tensor (None when label_k is 0)."""
    return meta[meta_len(n, t):].view(t, label_k) if label_k else None
