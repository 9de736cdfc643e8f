"""Fused layers whose weight is a DTensor (``torch.distributed.tensor.parallel``).

Under ``ColwiseParallel`` the weight is sharded on its rows (``Shard(0)``), under
``RowwiseParallel`` on its columns (``Shard(1)``). Either way each rank's slice of dW
is a sum over **all** tokens: colwise, dW[rows] = dY[:, rows]ᵀ X with X whole;
rowwise, dW[:, cols] = dYᵀ X[:, cols] with dY whole. So the fused update runs on the
local shard with local operands brought to those layouts, and equals the matching
slice of the unsharded update (proofs/sharding.md). Layouts that split the tokens
across ranks (data or context parallelism) would give each rank a partial sum: they
are refused (forge_kernels.token_split holds the alternatives).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch

from .weight_slice import WeightSlice, chunk_bounds

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

TOKEN_SPLIT_HELP = (
    "FORGE applies the optimizer rule to the gradient summed over every token of the step, inside one "
    "kernel; with the tokens split across ranks (data or context parallelism) or micro-batches, each part "
    "sees only a partial sum and a fused step per part is not the step. Use "
    "forge_kernels.token_split.linear_split_step (rules linear in weight, state and gradient: SGD with or "
    "without momentum; exact up to the rounding of the reassociated sums) or "
    "forge_kernels.token_split.materialized_split_step (any rule; materializes the fp32 gradient one bucket "
    "of rows at a time: bucket_rows x in_features x 4 bytes)")


def is_dtensor(t) -> bool:
    # Importing torch.distributed.tensor takes about half a second, and every fused layer
    # asks this on every call: a tensor can be a DTensor only once that module is loaded,
    # so the DTensor names are imported where a DTensor is already in hand.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _placement(t: DTensor):
    if t.device_mesh.ndim != 1:
        raise ValueError(f"fused layers support DTensors on a 1-D device mesh, got a {t.device_mesh.ndim}-D mesh")
    return t.placements[0]


def _sharded_dim(weight: DTensor):
    """0 (rows: colwise), 1 (columns: rowwise) or None (replicated)."""
    from torch.distributed.tensor import Replicate, Shard
    placement = _placement(weight)
    if isinstance(placement, Shard):
        return placement.dim % 2
    if isinstance(placement, Replicate):
        return None
    raise ValueError(f"a fused weight must be sharded (Shard(0) or Shard(1)) or replicated, got {placement}")


def check_input_layout(weight: DTensor, x) -> None:
    """Refuse an input the fused step cannot handle: not a DTensor, or split on its tokens."""
    from torch.distributed.tensor import Shard
    if not is_dtensor(x):
        raise TypeError("a fused layer with a DTensor weight takes a DTensor input (parallelize_module's input "
                        f"hooks make one); got {type(x).__name__}")
    _sharded_dim(weight)
    placement = _placement(x)
    if isinstance(placement, Shard) and placement.dim % x.ndim != x.ndim - 1:
        raise ValueError(f"the input of this fused layer is sharded on token dimension {placement.dim} "
                         f"({placement}): the tokens of one step are split across ranks. {TOKEN_SPLIT_HELP}")


def local_weight(weight) -> torch.Tensor:
    """The tensor the kernel updates in place: the weight itself, or its local shard."""
    return weight.to_local() if is_dtensor(weight) else weight


def local_operands(weight: DTensor, x: DTensor, dy: DTensor):
    """(x, dy) as local (T, K_local) and (T, N_local) tensors such that this rank's slice
    of dW is dyᵀx summed over all T tokens: x whole and dy on this rank's rows
    (colwise), x on this rank's columns and dy whole (rowwise), both whole (replicated)."""
    from torch.distributed.tensor import Replicate, Shard
    x_placement, dy_placement = {0: (Replicate(), Shard(1)), 1: (Shard(1), Replicate()),
                                 None: (Replicate(), Replicate())}[_sharded_dim(weight)]
    return (_waited(x.redistribute(placements=[x_placement]).to_local()),
            _waited(dy.redistribute(placements=[dy_placement]).to_local()))


def _waited(t: torch.Tensor) -> torch.Tensor:
    # parallelize_module's layout hooks redistribute asynchronously; the kernel reads
    # raw memory, so the collective must have finished.
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    return t.trigger_wait() if isinstance(t, AsyncCollectiveTensor) else t


def weight_slice(weight: DTensor) -> WeightSlice:
    """Where this rank's shard sits in the global weight (torch.chunk's split, which
    DTensor's Shard uses), checked against the shard's actual shape."""
    dim = _sharded_dim(weight)
    rows, cols = weight.shape
    local = weight.to_local().shape
    start = 0
    if dim is not None:
        size = weight.shape[dim]
        mesh = weight.device_mesh
        start, stop = chunk_bounds(size, mesh.size(), mesh.get_local_rank())
        if local[dim] != stop - start:
            raise ValueError(f"the local shard {tuple(local)} of a {tuple(weight.shape)} weight is not torch.chunk's "
                             f"split over {mesh.size()} ranks; fused layers need DTensor's even (chunk) sharding")
    return WeightSlice(start if dim == 0 else 0, start if dim == 1 else 0, (int(rows), int(cols)))

