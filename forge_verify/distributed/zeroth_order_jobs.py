"""Jobs for zeroth-order data parallelism (``fk.GRZO``/``fk.MeZO`` with ``group=``) on a
rank pool (``ranks.RankPool``): module-level functions run on every rank, returning what
tests/test_zeroth_order_parallel.py compares with the single process."""

import torch
import torch.distributed as dist
from torch import nn

import forge_kernels as fk

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


#: a hyperparameter fault: rank 0's value of that name in param_groups[0]
_SETTING_FAULTS = {"lr": 0.5, "sigma": 0.02, "eps": 0.02, "weight_decay": 0.1, "normalize": "none"}


def refused_everywhere(method: str, batch: int, fault: str) -> tuple:
    """(the error this rank raised as (type name, message), whether its parameters are
    unchanged) when rank 0 alone has a ``fault``: "nan" (a non-finite loss), "shape" (a
    closure returning the wrong thing), "batch" (one example fewer than the others),
    "seed" (another seed), a hyperparameter's name (another value of it, set in
    param_groups as a scheduler would), "weights" (its embedding's rows in reverse
    order: a permutation, which a plain sum of the weights would not see) or "reloaded"
    (after one good step on both ranks, the same reversal on rank 0, then
    ``opt.load_state_dict(opt.state_dict())`` on both: a resume compares the weights again)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, features, targets = _local(batch_invariant_data(batch), rank, world)
    if fault == "batch" and rank == 0:
        tokens, features, targets = tokens[1:], features[1:], targets[1:]
    model = BatchInvariantModel()
    if fault == "weights" and rank == 0:
        with torch.no_grad():
            model.tok.weight.copy_(model.tok.weight.flip(0))
    opt = zeroth_order_optimizer(method, model, group=dist.group.WORLD)
    if fault == "seed" and rank == 0:
        opt.seed += 1
    if fault in _SETTING_FAULTS and rank == 0:
        opt.param_groups[0][fault] = _SETTING_FAULTS[fault]

    def closure():
        losses = model(tokens, features, targets)
        if rank == 0 and fault == "nan":
            losses = losses * float("nan")
        if rank == 0 and fault == "shape":
            return losses.sum() if method == "GRZO" else losses
        return losses if method == "GRZO" else losses.mean()
    if fault == "reloaded":
        opt.step(closure)
        if rank == 0:
            with torch.no_grad():
                model.tok.weight.copy_(model.tok.weight.flip(0))
        opt.load_state_dict(opt.state_dict())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        opt.step(closure)
        error = None
    except Exception as caught:  # the test compares what each rank raised
        error = (type(caught).__name__, str(caught))
    unchanged = all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    return error, unchanged


def unequal_batch_steps(steps: int, batch: int) -> dict:
    """This rank's parameters after ``steps`` MeZO steps when rank 0 holds one example
    fewer than its slice (MeZO cannot see a local batch: not refused)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = _local(batch_invariant_data(batch), rank, world)
    if rank == 0:
        local = tuple(part[1:] for part in local)
    return zeroth_order_steps("MeZO", steps, local, group=dist.group.WORLD)


class ColumnParallelModel(nn.Module):
    """A tensor-parallel model with one column-parallel Linear: rank r of W holds rows
    [r·4/W, (r+1)·4/W) of a Linear(2, 4) (no bias) as a shard and all-gathers the local
    outputs; the embedding is replicated. Batch- and shard-invariant like
    ``BatchInvariantModel``: each output is a sum of two exact products (power-of-two
    features), and the loss is summed term by term, so the sharded model's losses are the
    whole's bit for bit and what is compared is the optimizers' handling of shards."""

    def __init__(self, rank: int = 0, world: int = 1, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        whole_tok = torch.randint(-3, 4, (7, 4), generator=generator).to(torch.float64)
        whole_lin = torch.randint(-3, 4, (4, 2), generator=generator).to(torch.float64)
        rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
        self.world = world
        self.tok = nn.Embedding(7, 4).double()
        self.lin = nn.Linear(2, rows.stop - rows.start, bias=False).double()
        with torch.no_grad():
            self.tok.weight.copy_(whole_tok)
            self.lin.weight.copy_(whole_lin[rows])
        self.shards = {"lin.weight": ((4, 2), (rows.start, 0))} if world > 1 else None

    def forward(self, tokens, features, targets):
        local = self.lin(features)
        if self.world > 1:
            parts = [torch.empty_like(local) for _ in range(self.world)]
            dist.all_gather(parts, local.contiguous())
            local = torch.cat(parts, dim=-1)
        h = self.tok(tokens) + local
        losses = torch.zeros(tokens.shape[0], dtype=torch.float64)
        for t in range(tokens.shape[1]):
            for c in range(4):
                losses = losses + (h[:, t, c] - targets[:, t, c]) ** 2
        return losses


def column_parallel_steps(method: str, steps: int, batch: int, world: int = 0) -> dict:
    """The parameters after ``steps`` steps of a rank of the tensor-parallel model (every
    rank holds the whole batch), or with ``world`` = 1 of the unsharded model."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if world == 0 else (0, world)
    tokens, features, _ = batch_invariant_data(batch)
    targets = torch.randint(-2, 3, (*tokens.shape, 4), generator=torch.Generator().manual_seed(2)).double()
    model = ColumnParallelModel(rank, world)
    if method == "GRZO":
        opt = fk.GRZO(model, lr=0.05, sigma=1e-2, seed=11, shards=model.shards)
        closure = lambda: model(tokens, features, targets)  # noqa: E731
    else:
        opt = fk.MeZO(model, lr=0.05, eps=1e-2, seed=11, shards=model.shards)
        closure = lambda: model(tokens, features, targets).mean()  # noqa: E731
    for _ in range(steps):
        opt.step(closure)
    return {n: p.detach().clone() for n, p in model.named_parameters()}
