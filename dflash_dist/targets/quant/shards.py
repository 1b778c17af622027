"""FP8 linears of a tensor-parallel target replica: each rank's shard of the FP8 weight and its scales.

transformers' tensor-parallel load leaves every sharded Linear weight a DTensor whose placement says how it is
split: ``Shard(0)`` (colwise: this rank's output channels; the next op takes the local slice as it is) or
``Shard(1)`` (rowwise: this rank's input channels; the outputs are partial sums, all-reduced over the replica,
the bias added once after). The FP8Linear that replaces such a Linear holds the local shard and does the same
reduction itself (``reduce_group``), so a replica computes what one rank computes:

* the weight scale of a rowwise shard is the amax of the whole output row (all-reduced over the replica), so the
  FP8 weight values are exactly those of the one-rank target; a colwise shard's rows are whole rows already;
* a pre-quantized checkpoint's weight is read whole, brought to per-row scales as on one rank, then sliced;
* the activations of the ``scaled_mm`` kernel are quantized per token over the rank's own input channels (a
  rowwise shard sees its slice only), as the serving engines' tensor-parallel FP8 linears do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from dflash_dist.config import ConfigError
from dflash_dist.targets.quant.fp8 import quantize_rows

__all__ = ["Layout", "layout_of", "local_tensor", "local_slice", "quantize_local", "local_bias",
           "check_replica_layouts"]


@dataclass(frozen=True)
class Layout:
    """How a Linear's weight is split over the replica: ``style`` colwise (dim 0) or rowwise (dim 1); ``index``
    this rank's position on the mesh, ``size`` the replica's ranks, ``group`` its process group."""

    style: str
    dim: int
    index: int
    size: int
    group: Any


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # older torch
        from torch.distributed._tensor import DTensor
    return DTensor


def layout_of(linear: nn.Linear) -> Optional[Layout]:
    """The split of ``linear``'s weight, or None for a whole (plain or replicated) weight. Refuses a layout this
    module cannot reproduce (a mesh of more than one axis, a placement other than Shard or Replicate)."""
    w = linear.weight
    if not isinstance(w, _dtensor_class()):
        return None
    mesh, placements = w.device_mesh, tuple(w.placements)
    if mesh.ndim != 1 or len(placements) != 1:
        raise ConfigError(f"FP8 on a replica: a weight on a {mesh.ndim}-d mesh with placements {placements} "
                          "(one tensor-parallel axis only)")
    p = placements[0]
    if p.is_replicate():
        return None
    if not p.is_shard():
        raise ConfigError(f"FP8 on a replica: a Linear weight with placement {p} (Shard or Replicate only)")
    dim = p.dim % 2
    return Layout("colwise" if dim == 0 else "rowwise", dim, int(mesh.get_local_rank()), int(mesh.size()),
                  mesh.get_group())


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, _dtensor_class()) else t


def local_slice(full: torch.Tensor, layout: Optional[Layout], local_shape: tuple) -> torch.Tensor:
    """This rank's slice of a whole tensor (DTensor's even split: ``chunk`` along the layout's dim), checked
    against the shape the loaded shard has."""
    part = full if layout is None else full.chunk(layout.size, dim=layout.dim)[layout.index]
    if tuple(part.shape) != tuple(local_shape):
        raise ConfigError(f"FP8 on a replica: the checkpoint slice {tuple(part.shape)} is not this rank's shard "
                          f"{tuple(local_shape)}")
    return part.contiguous()


def quantize_local(linear: nn.Linear, layout: Optional[Layout]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 local weight, fp32 scale per local output row) of a loaded Linear's shard. A rowwise shard's scale
    is its whole row's: the amax all-reduced (max) over the replica."""
    w = local_tensor(linear.weight.detach()).float()
    amax = w.abs().amax(dim=1)
    if layout is not None and layout.style == "rowwise":
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=layout.group)
    return quantize_rows(w, amax)


def local_bias(linear: nn.Linear) -> Optional[torch.Tensor]:
    """The bias this rank adds: its slice for a colwise shard, the whole (replicated) bias otherwise."""
    return None if linear.bias is None else local_tensor(linear.bias.detach()).clone()


def check_replica_layouts(layers: nn.Module) -> None:
    """On a replica, refuse a tensor-parallel load that left no Linear weight a DTensor: the shards' layouts would
    be unknown and an FP8 linear could neither slice a checkpoint nor know to reduce its outputs."""
    linears = [m for m in layers.modules() if isinstance(m, nn.Linear)]
    if linears and not any(isinstance(m.weight, _dtensor_class()) for m in linears):
        import transformers
        raise ConfigError(f"FP8 on a replica: transformers {transformers.__version__}'s tensor-parallel load keeps "
                          "no layout (DTensor placement) on the decoder layers' weights; set "
                          "target.tensor_parallel=1 or use a transformers whose plan keeps them")
