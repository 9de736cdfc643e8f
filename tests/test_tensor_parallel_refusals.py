"""Fused layers on DTensor weights refuse, with errors naming the way out: inputs split
on their tokens (data or context parallelism), a non-DTensor input, and a weight
replaced by parallelize_module after fuse."""

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import forge_kernels as fk
from forge_verify.distributed.sharding import device

pytestmark = pytest.mark.distributed


def _model_with_weight(placement):
    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    model = nn.Sequential(nn.Linear(6, 4, bias=False).to(device()))
    model[0].weight = nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh, [placement]))
    return fk.fuse(model, fk.AdamW()), mesh


def _error_of(call):
    try:
        call()
    except (ValueError, TypeError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _data_parallel_input():
    model, mesh = _model_with_weight(Replicate())
    return _error_of(lambda: model(DTensor.from_local(torch.randn(3, 6, device=device()), mesh, [Shard(0)])))


def _context_parallel_input():
    model, mesh = _model_with_weight(Shard(0))
    return _error_of(lambda: model(DTensor.from_local(torch.randn(2, 3, 6, device=device()), mesh, [Shard(1)])))


def _plain_input():
    model, _ = _model_with_weight(Shard(0))
    return _error_of(lambda: model(torch.randn(3, 6, device=device())))


def _parallelized_after_fuse():
    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    model = fk.fuse(nn.Sequential(nn.Linear(6, 4).to(device())), fk.AdamW())
    parallelize_module(model, mesh, {"0": ColwiseParallel()})
    return _error_of(lambda: model(torch.randn(3, 6, device=device())))


@pytest.mark.parametrize("job, message", [
    (_data_parallel_input, r"ValueError: .*sharded on token dimension 0.*linear_split_step.*materialized_split_step"),
    (_context_parallel_input, r"ValueError: .*sharded on token dimension 1.*tokens of one step are split"),
    (_plain_input, r"TypeError: .*takes a DTensor input"),
    (_parallelized_after_fuse, r"RuntimeError: .*replaced after fuse.*parallelize_module first"),
], ids=["data-parallel", "context-parallel", "plain-input", "parallelized-after-fuse"])
def test_refused_with_a_way_out(job, message, rank_pool):
    for rank, error in enumerate(rank_pool(2).run(job)):
        assert error is not None, f"rank {rank}: no error raised"
        assert re.search(message, error, re.S), f"rank {rank}: {error}"


def test_a_process_outside_the_group_is_refused(monkeypatch):
    """torch answers -1 for the rank and world size of a process outside a group; the
    shard bounds of that answer were an empty shard, built without a word."""
    from forge_kernels import parallel_linear

    monkeypatch.setattr(parallel_linear.dist, "get_rank", lambda group=None: -1)
    monkeypatch.setattr(parallel_linear.dist, "get_world_size", lambda group=None: -1)
    with pytest.raises(ValueError, match="not a member of the tensor-parallel group"):
        parallel_linear.ColumnParallelForgeLinear(nn.Linear(6, 4), fk.SGD(), group=object())
