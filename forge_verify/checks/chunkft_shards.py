"""ChunkFT under tensor parallelism, simulated rank by rank in one process
(properties/test_chunkft_tensor_parallel.py).

A column-parallel layer holds rows of W (and of its bias) and sees X on all tokens and
dY on its rows; a row-parallel layer holds columns of W and sees X on its columns and
dY whole (``forge_kernels.parallel_linear``: the collectives deliver exactly these
operands, and ``properties/test_sharding_exactness.py`` checks that they do). Given
those operands, ``sharded_steps_are_slices_of_unsharded`` checks the ChunkFT part: the
global plan intersected with each rank's shard, stepped with the shard's global
placement, gives every rank's local weights the bits of the matching slice of the
unsharded ChunkFT run, after every step, over two cycles of chunks.
"""

import copy

import torch
from torch import nn

import forge_kernels as fk

from ..numerics.bits import assert_bitwise_equal
from .problems import Regime


class ColumnThenRow(nn.Module):
    """A column-parallel Linear with bias (``up``) and a row-parallel one with a replicated
    bias (``down``), each fed its own operands: forward(x_up, x_down)."""

    def __init__(self, inputs, hidden, outputs, down_bias=True):
        super().__init__()
        self.up, self.down = nn.Linear(inputs, hidden), nn.Linear(hidden, outputs, bias=down_bias)

    def forward(self, x_up, x_down):
        return self.up(x_up), self.down(x_down)


def bounds(size, world, rank):
    # torch.chunk's split, from torch.chunk itself (not the library's chunk_bounds)
    parts = torch.arange(size).chunk(world)
    if rank >= len(parts):
        return size, size
    return int(parts[rank][0]), int(parts[rank][-1]) + 1


def _shard(model, world, rank):
    """(local model, shards) for ``rank``: up's rows and bias rows, down's columns."""
    hidden = model.up.out_features
    r0, r1 = bounds(hidden, world, rank)
    local = ColumnThenRow(model.up.in_features, r1 - r0, model.down.out_features).to(model.up.weight.device,
                                                                                     model.up.weight.dtype)
    with torch.no_grad():
        local.up.weight.copy_(model.up.weight[r0:r1])
        local.up.bias.copy_(model.up.bias[r0:r1])
        local.down.weight.copy_(model.down.weight[:, r0:r1])
        local.down.bias.copy_(model.down.bias)
    shards = {"up.weight": fk.WeightSlice(r0, 0, tuple(model.up.weight.shape)),
              "up.bias": fk.WeightSlice(0, r0, (1, hidden)),
              "down.weight": fk.WeightSlice(0, r0, tuple(model.down.weight.shape))}
    return local, shards, (r0, r1)


def _linear_loss(model, x_up, dy_up, x_down, dy_down):
    up, down = model(x_up, x_down)
    return (up * dy_up).sum() + (down * dy_down).sum()


def sharded_steps_are_slices_of_unsharded(rule, regime: Regime, split, world, chunks, inputs, hidden, outputs,
                                          tokens, seed):
    """Runs 2·chunks steps unsharded and on each of ``world`` simulated ranks; raises
    AssertionError at the first local weight whose bits are not the unsharded slice's."""
    torch.manual_seed(seed)
    # Built on the CPU (the same initial bits everywhere), stepped where the kernels run.
    whole = ColumnThenRow(inputs, hidden, outputs).to(fk.kernel_device(), regime.weight)
    options = dict(split=split, seed=regime.seed, state_format=regime.state_format, rounding=regime.rounding)
    ranks = []
    for rank in range(world):
        local, shards, bounds = _shard(whole, world, rank)
        ranks.append((local, fk.ChunkFT(local, copy.deepcopy(rule), chunks, shards=shards, **options), bounds))
    ctl = fk.ChunkFT(whole, copy.deepcopy(rule), chunks, **options)
    gen = torch.Generator().manual_seed(seed + 1)
    draw = lambda *shape: torch.randn(*shape, generator=gen).to(fk.kernel_device(), regime.weight)  # noqa: E731
    for t in range(2 * chunks):
        x_up, dy_up, x_down, dy_down = draw(tokens, inputs), draw(tokens, hidden), draw(tokens, hidden), draw(
            tokens, outputs)
        for local, local_ctl, (r0, r1) in ranks:
            if local_ctl.chunk_slices(local_ctl.active_chunk) != ctl.chunk_slices(ctl.active_chunk):
                raise AssertionError(f"step {t}: a rank's global plan differs from the unsharded one")
            local_ctl.step(lambda: _linear_loss(local, x_up, dy_up[:, r0:r1], x_down[:, r0:r1], dy_down))
        chunk = ctl.active_chunk
        ctl.step(lambda: _linear_loss(whole, x_up, dy_up, x_down, dy_down))
        what = (f"step {t}, chunk {chunk} {ctl.chunk_slices(chunk)} [{rule!r}; {regime.describe()}; split={split}; "
                f"{world} ranks; ({inputs}, {hidden}, {outputs}), {tokens} tokens]")
        for rank, (local, _, (r0, r1)) in enumerate(ranks):
            expected = {"up.weight": whole.up.weight[r0:r1], "up.bias": whole.up.bias[r0:r1],
                        "down.weight": whole.down.weight[:, r0:r1], "down.bias": whole.down.bias}
            for name, param in local.named_parameters():
                assert_bitwise_equal(param.detach(), expected[name].detach(),
                                     f"{what}: rank {rank} rows/cols {r0}:{r1}, {name!r} vs the unsharded slice")
