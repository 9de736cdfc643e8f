"""Jobs for GIFT's layer selection by range hits (``fk.gift.RangeHitSelection``) and for
the hook's asynchrony (``GiftState(overlap=...)``), compared in
``properties/test_gift_selection.py`` and ``properties/test_gift_overlap.py``."""

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import forge_kernels as fk

from ..numerics.bits import assert_bitwise_equal

#: decades spanned by the column scales of each branch's input, per rank: branch 0 and 1
#: heavy-tailed (rank 0 ranks branch 0 first, rank 1 branch 1), branches 2 and 3 near Gaussian
SPANS = ((8.0, 4.5, 1.0, 1.0), (5.0, 6.5, 1.0, 1.0))


class Branches(nn.Module):
    """Four bias-free linear layers, each on its own input; the output is their sum."""

    def __init__(self, features=64, outputs=16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(features, outputs, bias=False) for _ in range(4))

    def forward(self, xs):
        return sum(layer(x) for layer, x in zip(self.layers, xs))


def range_hit_selection(seed: int, count: int, warmup_steps: int = 3, steps: int = 5, overlap: bool = True):
    """DDP with GIFT (E4M3) choosing ``count`` of the four branches by range hits over
    ``warmup_steps`` steps, each rank's inputs spanning ``SPANS[rank]`` decades per branch
    (column scales 10^0 … 10^-span), loss Σ out ∘ target: the gradient of branch i is
    targetᵀ x_i, whose columns span as many decades. Returns this rank's counts, the
    summed counts, the selection, the indices of the layers on the GIFT route and the
    factor digests."""
    rank = dist.get_rank()
    torch.manual_seed(seed)
    model = Branches()
    ddp = DistributedDataParallel(model)
    selection = fk.gift.RangeHitSelection(list(model.layers), count, warmup_steps)
    state = fk.gift.GiftState(None, "e4m3", 8, 50, layers=selection, overlap=overlap)
    ddp.register_comm_hook(state, fk.gift.gift_hook)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    for _ in range(steps):
        xs = [torch.randn(32, 64, generator=g) * torch.logspace(0, -span, 64) for span in SPANS[rank]]
        target = torch.randn(32, 16, generator=g)
        ddp.zero_grad(set_to_none=True)
        (ddp(xs) * target).sum().backward()
    state.close()
    on_route = [list(model.layers).index(layer) for layer in state.layers]
    return (selection.local_hits, selection.local_elements, selection.total_hits, selection.selected, on_route,
            state.digests, selection.state_dict())


def _mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def overlap_versus_inline(seed: int, fmt: str, steps: int, bucket_cap_mb: float):
    """Two twins trained alike through DDP with GIFT (whitening rank 8 on both layers,
    refresh every 2 steps, error feedback), one reducing on the communication thread
    (``overlap=True``), one inside the hook: every gradient bit for bit, every step."""
    rank = dist.get_rank()
    nets, states = [], []
    for overlap in (True, False):
        model = _mlp(seed)
        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        state = fk.gift.GiftState(None, fmt, 8, 2, layers=[model[0], model[2]], overlap=overlap)
        ddp.register_comm_hook(state, fk.gift.gift_hook)
        nets.append((model, ddp, torch.optim.SGD(model.parameters(), lr=0.05)))
        states.append(state)
    mix = torch.randn(32, 32, generator=torch.Generator().manual_seed(seed)) * torch.logspace(0, -2, 32)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    for step in range(steps):
        x = torch.randn(16, 32, generator=g) @ mix
        grads = []
        for model, ddp, optimizer in nets:
            optimizer.zero_grad(set_to_none=True)
            ((ddp(x) - x) ** 2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            optimizer.step()
        for i, (a, b) in enumerate(zip(*grads)):
            assert_bitwise_equal(a, b, f"rank {rank}, step {step}, gradient {i}")
    states[0].close()
    return [d for _, _, d in states[0].digests] == [d for _, _, d in states[1].digests]


def hook_returns_before_the_peer_arrives(seed: int, delay_s: float, overlap: bool):
    """Two steps through DDP with GIFT (DDP puts every gradient in one bucket on its first
    step and then rebuilds its buckets, here to several); on the second, rank 1 starts its
    backward ``delay_s`` late. On rank 0, per bucket of the second step: the seconds
    ``gift_hook`` took to return and whether its future was already complete."""
    rank = dist.get_rank()
    model = _mlp(seed)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)
    state = fk.gift.GiftState(None, "e4m3", 8, 50, layers=[model[0]], overlap=overlap)
    returns = []

    def timed(state, bucket):
        start = time.perf_counter()
        future = fk.gift.gift_hook(state, bucket)
        returns.append((time.perf_counter() - start, future.done()))
        return future

    ddp.register_comm_hook(state, timed)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    for step in range(2):
        returns.clear()
        x = torch.randn(16, 32, generator=g)
        loss = ((ddp(x) - x) ** 2).mean()
        if rank == 1 and step == 1:
            time.sleep(delay_s)
        loss.backward()
    state.close()
    return returns


def non_finite_on_one_rank(seed: int, exchange: str):
    """Rank 1's second tensor holds an inf: every rank's exchange raises (none waits for a
    peer that gave up), and no residual was written. (error message, residual keys)."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    if rank == 1:
        y[2, 3] = float("inf")
    state = fk.gift.GiftState(None, "e4m3", layers=(), exchange=exchange)
    try:
        state.exchange([("x", x, None), ("y", y, None)])
    except fk.NonFiniteInputError as error:
        return str(error), sorted(state.residuals)
    return None, sorted(state.residuals)


def resume_versus_uninterrupted(seed: int, fmt: str, before: int, after: int, select: bool,
                                exchange: str = "reduce_scatter"):
    """DDP with GIFT (refresh every 3 steps, error feedback; explicit layers, or a
    selection of 1 of 2 over a 2-step window): ``before + after`` steps in one go, against
    ``before`` steps, the model's, optimizer's and hook's state saved (``state_dict``), a
    fresh model, optimizer and hook loaded from it, and ``after`` more steps. Both
    models' parameters, and the hook's factor digests."""
    rank = dist.get_rank()

    def build(initial=None):
        model = _mlp(seed)
        if initial is not None:
            model.load_state_dict(initial)
        ddp = DistributedDataParallel(model)
        layers = (fk.gift.RangeHitSelection([model[0], model[2]], 1, 2) if select else [model[0], model[2]])
        state = fk.gift.GiftState(None, fmt, 8, 3, layers=layers, exchange=exchange)
        ddp.register_comm_hook(state, fk.gift.gift_hook)
        return model, ddp, state, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    mix = torch.randn(32, 32, generator=torch.Generator().manual_seed(seed)) * torch.logspace(0, -2, 32)
    batches = [torch.randn(16, 32, generator=torch.Generator().manual_seed(seed * 1000 + rank * 100 + t)) @ mix
               for t in range(before + after)]

    def train(model, ddp, optimizer, xs):
        for x in xs:
            optimizer.zero_grad(set_to_none=True)
            ((ddp(x) - x) ** 2).mean().backward()
            optimizer.step()

    whole = build()
    train(whole[0], whole[1], whole[3], batches)
    first = build()
    train(first[0], first[1], first[3], batches[:before])
    saved = (first[0].state_dict(), first[3].state_dict(), first[2].state_dict(list(first[0].parameters())))
    second = build(saved[0])
    second[3].load_state_dict(saved[1])
    second[2].load_state_dict(saved[2], list(second[0].parameters()))
    train(second[0], second[1], second[3], batches[before:])
    for state in (whole[2], first[2], second[2]):
        state.close()
    return ([p.detach().clone() for p in whole[0].parameters()], [p.detach().clone() for p in second[0].parameters()],
            whole[2].digests, second[2].digests)
