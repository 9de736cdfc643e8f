"""Tensor parallelism: the global chunk plan intersected with this rank's shard.

Under tensor parallelism a rank holds a shard of some nn.Linear weights (rows for a
column-parallel layer, columns for a row-parallel one) and of their biases. Every rank
plans the chunks on the *global* shapes, so all ranks agree on which global rows or
columns chunk c holds; each rank steps the part of them inside its shard. A shard's
place in the global tensor is a ``WeightSlice`` (a 1-D tensor as one row: global shape
``(1, n)``); the kernels key stochastic rounding and q8 blocks on global indices, so a
shard's step is the slice of the unsharded one (properties/test_chunkft_tensor_parallel.py).
"""

import torch

from ..weight_slice import WeightSlice
from .plan import Slice


def placements(params: dict, shards: dict, q8_state: bool) -> dict:
    """{name: WeightSlice} for every trainable parameter: the given shard, else the whole
    tensor. Refuses a shard of an unknown parameter or one that does not fit."""
    if not isinstance(shards, dict):
        raise TypeError(f"shards must be a dict {{parameter name: WeightSlice}}, got {type(shards).__name__}")
    unknown = sorted(set(shards) - set(params))
    if unknown:
        raise ValueError(f"shards names {unknown}, which are not trainable parameters of the model")
    out = {}
    for name, param in params.items():
        local = (1, param.shape[0]) if param.dim() == 1 else tuple(param.shape)
        place = shards.get(name)
        if place is None:
            out[name] = WeightSlice(0, 0, local)
            continue
        if not isinstance(place, WeightSlice):
            raise TypeError(f"shards[{name!r}] must be a forge_kernels.WeightSlice, got {type(place).__name__}")
        if param.dim() == 1 and (place.global_shape[0] != 1 or place.row_start != 0):
            raise ValueError(f"shards[{name!r}]: a 1-D parameter is placed as one row, WeightSlice(0, start, "
                             f"(1, global length)); got {place}")
        try:
            place.check_fits(local, q8_state)
        except ValueError as error:
            raise ValueError(f"shards[{name!r}]: {error}") from None
        out[name] = place
    return out


def global_tensor(param, place: WeightSlice):
    """A meta tensor of the parameter's global shape and dtype, for planning."""
    shape = (place.global_shape[1],) if param.dim() == 1 else place.global_shape
    return torch.empty(shape, dtype=param.dtype, device="meta")


def _offset_and_length(piece: Slice, param, place: WeightSlice):
    along_columns = param.dim() == 1 or piece.dim == 1
    if along_columns:
        return place.col_start, param.shape[-1]
    return place.row_start, param.shape[0]


def local_piece(piece: Slice, param, place: WeightSlice):
    """The part of the global ``piece`` inside this rank's shard, in local indices; None
    when the shard holds none of it."""
    offset, length = _offset_and_length(piece, param, place)
    start, stop = max(piece.start - offset, 0), min(piece.stop - offset, length)
    return Slice(piece.name, piece.dim, start, stop) if stop > start else None


def kernel_slice(piece: Slice, param, place: WeightSlice) -> WeightSlice:
    """Where the local slice ``piece`` (as stepped: its rows, its columns, a 1-D range as
    one row) sits in the global tensor."""
    if param.dim() == 2 and piece.dim == 0:
        return WeightSlice(place.row_start + piece.start, place.col_start, place.global_shape)
    return WeightSlice(place.row_start, place.col_start + piece.start, place.global_shape)
