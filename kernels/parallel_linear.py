"""Megatron-style column- and row-parallel fused linears, with explicit collectives.

The pattern Megatron-LM uses (``ColumnParallelLinear``/``RowParallelLinear``), here
with a ``ForgeLinear`` on the local shard. Tokens are dimension 0 of the activations.

* column-parallel: W[rows] on each rank. Without sequence parallelism the input is
  replicated (its gradient all-reduced); with it the input arrives sharded on tokens
  and is all-gathered (its gradient reduce-scattered). The output stays sharded on
  features. The fused update sees X on all tokens and dY[:, rows].
* row-parallel: W[:, cols] on each rank, input sharded on features. The partial
  outputs are all-reduced, or reduce-scattered onto token shards with sequence
  parallelism (whose backward all-gathers dY). The fused update sees X[:, cols] and
  dY on all tokens.

Each rank's update is thus a sum over every token, and with the shard's
``WeightSlice`` its stochastic rounding is that of the unsharded weight.
"""

import torch
import torch.distributed as dist
from torch import nn

from .linear import ForgeLinear
from .weight_slice import WeightSlice, chunk_bounds

# torch 2.13 renamed these collectives (the old names warn); torch 2.11 has only the old.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_tokens(x, group):
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_tokens(x, group):
    world = dist.get_world_size(group)
    if x.shape[0] % world:
        raise ValueError(f"sequence parallelism splits {x.shape[0]} tokens over {world} ranks: not divisible")
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def _all_reduce(x, group):
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


class _CopyToParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_tokens(grad, ctx.group), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_tokens(grad, ctx.group), None


def _chunk(size, group):
    """This rank's [start, stop) of ``size`` split as torch.chunk splits it."""
    rank = dist.get_rank(group)
    if rank < 0:  # torch's answer for a process outside the group; it would get an empty shard
        raise ValueError("this process is not a member of the tensor-parallel group given: build the layer only on "
                         "the group's ranks")
    return chunk_bounds(size, dist.get_world_size(group), rank)


def _local_linear(linear, rows, cols, bias):
    weight = linear.weight.detach()[rows[0]:rows[1], cols[0]:cols[1]]
    local = nn.Linear(weight.shape[1], weight.shape[0], bias=bias, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        local.weight.copy_(weight)
        if bias:
            local.bias.copy_(linear.bias.detach()[rows[0]:rows[1]])
    return local


class ColumnParallelForgeLinear(nn.Module):
    """This rank's rows of ``linear`` (copied), fused; output sharded on features."""

    def __init__(self, linear: nn.Linear, rule, *, group=None, sequence_parallel=False, **fuse_options):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        rows = _chunk(linear.out_features, group)
        self.linear = ForgeLinear.from_linear(
            _local_linear(linear, rows, (0, linear.in_features), linear.bias is not None), rule,
            weight_slice=WeightSlice(rows[0], 0, tuple(linear.weight.shape)), **fuse_options)

    def forward(self, x):
        if self.sequence_parallel:
            x = _GatherFromSequenceParallelRegion.apply(x, self.group)
        else:
            x = _CopyToParallelRegion.apply(x, self.group)
        return self.linear(x)


class RowParallelForgeLinear(nn.Module):
    """This rank's columns of ``linear`` (copied), fused; input sharded on features,
    output all-reduced (or reduce-scattered onto token shards)."""

    def __init__(self, linear: nn.Linear, rule, *, group=None, sequence_parallel=False, **fuse_options):
        super().__init__()
        if linear.bias is not None and sequence_parallel:
            # Each rank would see the bias gradient of its own tokens only; Megatron
            # all-reduces it separately. Not done here: refuse rather than drift.
            raise ValueError("a row-parallel layer with sequence parallelism takes no bias here: its gradient "
                             "would be a per-rank partial sum")
        self.group, self.sequence_parallel = group, sequence_parallel
        cols = _chunk(linear.in_features, group)
        self.linear = ForgeLinear.from_linear(
            _local_linear(linear, (0, linear.out_features), cols, False), rule,
            weight_slice=WeightSlice(0, cols[0], tuple(linear.weight.shape)), **fuse_options)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        y = self.linear(x)
        if self.sequence_parallel:
            y = _ReduceScatterToSequenceParallelRegion.apply(y, self.group)
        else:
            y = _ReduceFromParallelRegion.apply(y, self.group)
        return y if self.bias is None else y + self.bias
