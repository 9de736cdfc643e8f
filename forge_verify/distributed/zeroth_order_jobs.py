"""Jobs for zeroth-order data parallelism (``fk.GRZO``/``fk.MeZO`` with ``group=``) on a
rank pool (``ranks.RankPool``): module-level functions run on every rank, returning what
tests/test_zeroth_order_parallel.py compares with the single process."""

import torch
import torch.distributed as dist

from ..checks.zeroth_order import BatchInvariantModel, batch_invariant_data, zeroth_order_optimizer, \
    zeroth_order_steps


def _local(data: tuple, rank: int, world: int) -> tuple:
    """Rank ``rank``'s examples: the ``rank``-th of ``world`` equal slices along dim 0."""
    return tuple(part.chunk(world)[rank] for part in data)


def data_parallel_steps(method: str, steps: int, batch: int) -> dict:
    """This rank's parameters after ``steps`` data-parallel steps on its slice of the
    batch of ``batch`` examples."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = _local(batch_invariant_data(batch), rank, world)
    return zeroth_order_steps(method, steps, local, group=dist.group.WORLD)


def refused_everywhere(method: str, batch: int, fault: str) -> tuple:
    """(the error this rank raised as (type name, message), whether its parameters are
    unchanged) when rank 0 alone has a ``fault``: "nan" (a non-finite loss), "shape" (a
    closure returning the wrong thing), "batch" (one example fewer than the others) or
    "seed" (another seed)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, features, targets = _local(batch_invariant_data(batch), rank, world)
    if fault == "batch" and rank == 0:
        tokens, features, targets = tokens[1:], features[1:], targets[1:]
    model = BatchInvariantModel()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = zeroth_order_optimizer(method, model, group=dist.group.WORLD)
    if fault == "seed" and rank == 0:
        opt.seed += 1

    def closure():
        losses = model(tokens, features, targets)
        if rank == 0 and fault == "nan":
            losses = losses * float("nan")
        if rank == 0 and fault == "shape":
            return losses.sum() if method == "GRZO" else losses
        return losses if method == "GRZO" else losses.mean()
    try:
        opt.step(closure)
        error = None
    except Exception as caught:  # the test compares what each rank raised
        error = (type(caught).__name__, str(caught))
    unchanged = all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    return error, unchanged
