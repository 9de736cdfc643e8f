"""ChunkFT under data and tensor parallelism, as rank jobs (properties/test_chunkft_data_parallel.py,
properties/test_chunkft_tensor_parallel.py).

Every rank builds the same seeded model and controller with ``process_group`` the world.

* ``equal_data_is_the_single_process_step``: with the same batch on every rank, the
  averaged gradient of two ranks is the rank's own (g + g is exact, and so is the
  halving), and the oracle epilogue on it gives the fused step's bits: so each DP step
  equals the single-process ChunkFT step on that batch, bitwise, weights and state. It
  also counts what crosses the wire: only the active chunk's slices, 4 bytes an element.
* ``dyadic_split_is_the_concatenated_step``: different small-integer batches per rank
  and power-of-two SGD scalars, Linear and Embedding only: every sum is exact in fp32
  in any order, so DP equals one process stepping the concatenated batch, bitwise; a
  rank stepping alone (no reduction) does not.
* ``tp_layers_are_slices_of_unsharded``: tensor parallelism with the collectives in the
  graph (Megatron's copy-to and reduce-from-parallel-region Functions, as
  ``forge_kernels.parallel_linear`` uses them), each rank's ChunkFT stepping its shards:
  its weights are the unsharded ChunkFT run's slices, bitwise, after every step. The
  loss is linear in each layer's output, so every dY is the loss's own weights (the
  row-parallel all-reduce reorders the forward's sums, but no gradient reads them).
* ``split_batch_deviation``: different generic batches per rank: the ranks end with
  the same bits (they step one averaged gradient), and their distance to one process
  stepping the concatenated batch is measured, not hidden: the concatenated step sums
  all tokens in one order, the DP step sums each rank's tokens and then the two sums.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import forge_kernels as fk
from forge_kernels.chunkft import data_parallel

from ..checks.chunkft import ChunkProblem
from ..checks.chunkft_shards import ColumnThenRow, bounds
from ..numerics.bits import assert_bitwise_equal, int_view, ulp_distance


def _loss(model, tokens, targets, vocab):
    logits = model(tokens)
    return F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))


def _params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def equal_data_is_the_single_process_step(problem: ChunkProblem, rule, regime, chunks, split, steps,
                                          dp_options=None):
    """Job: DP ChunkFT (with ``dp_options``, e.g. the host store and prefetch) on the same
    batches as the single-process run (device store), bitwise after every step; returns
    [(bytes all-reduced, ctl.reduced_bytes(chunk), local elements of the chunk)] per step."""
    batches = problem.batches(steps)
    options = dict(split=split, seed=regime.seed, state_format=regime.state_format, rounding=regime.rounding)
    dp_model, alone_model = problem.model(regime.weight), problem.model(regime.weight)
    dp = fk.ChunkFT(dp_model, copy.deepcopy(rule), chunks, process_group=dist.group.WORLD, **options,
                    **(dp_options or {}))
    alone = fk.ChunkFT(alone_model, copy.deepcopy(rule), chunks, **options)
    sent, original = [], data_parallel.average_over_ranks

    def counted(grad, group):  # what this rank puts on the wire
        sent.append(grad.numel() * grad.element_size())
        return original(grad, group)
    data_parallel.average_over_ranks = counted
    wire = []
    try:
        for t, (tokens, targets) in enumerate(batches):
            chunk = dp.active_chunk
            sent.clear()
            dp.step(lambda: _loss(dp_model, tokens, targets, problem.vocab))
            alone.step(lambda: _loss(alone_model, tokens, targets, problem.vocab))
            params = dict(dp_model.named_parameters())
            elements = sum((stop - start) * (params[name].shape[1 - dim] if params[name].dim() == 2 else 1)
                           for name, dim, start, stop in dp.local_slices(chunk))
            wire.append((sum(sent), dp.reduced_bytes(chunk), elements))
            what = f"rank {dist.get_rank()}, step {t}, chunk {chunk} [{regime.describe()}; {split}; {rule!r}]"
            for (name, a), b in zip(dp_model.named_parameters(), alone_model.parameters(), strict=True):
                assert_bitwise_equal(a.detach(), b.detach(), f"{what}: {name!r}, DP vs single process")
            for name, state in dp.chunk_state(chunk).items():
                for slot, tensor in state.items():
                    assert_bitwise_equal(tensor, alone.chunk_state(chunk)[name][slot], f"{what}: state {name} {slot}")
    finally:
        data_parallel.average_over_ranks = original
    return wire


class DyadicModel(nn.Module):
    """Embedding → Linear with bias → Linear, small-integer weights: on small-integer
    inputs every product and sum of the forward and backward is an exact fp32 value."""

    def __init__(self, vocab, width, hidden, out, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed, self.up, self.down = nn.Embedding(vocab, width), nn.Linear(width, hidden), nn.Linear(hidden, out)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-2, 3, p.shape, generator=gen).float())

    def forward(self, tokens):
        return self.down(self.up(self.embed(tokens)))


def _dyadic_batches(steps, world, length, vocab, out, seed):
    """Per step, each rank's (tokens, output weights): the linear loss Σ model(tokens) ⊙ G."""
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, vocab, (1, length), generator=gen),
              torch.randint(-2, 3, (1, length, out), generator=gen).float()) for _ in range(world)]
            for _ in range(steps)]


def dyadic_split_is_the_concatenated_step(chunks, split, steps, seed=0):
    """Job: {"dp_vs_concatenated": max ulp, "alone_vs_concatenated": max ulp} over the
    parameters after ``steps`` steps (SGD lr 2⁻⁴, momentum ½, weight decay 2⁻³)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    vocab, width, hidden, out, length = 7, 6, 5, 4, 3
    batches = _dyadic_batches(steps, world, length, vocab, out, seed)
    rule = lambda: fk.SGD(lr=2**-4, momentum=0.5, weight_decay=2**-3)  # noqa: E731
    models = {run: DyadicModel(vocab, width, hidden, out, seed) for run in ("dp", "alone", "concatenated")}
    ctls = {"dp": fk.ChunkFT(models["dp"], rule(), chunks, split=split, process_group=dist.group.WORLD),
            "alone": fk.ChunkFT(models["alone"], rule(), chunks, split=split),
            "concatenated": fk.ChunkFT(models["concatenated"], rule(), chunks, split=split)}
    for per_rank in batches:
        tokens, weights = per_rank[rank]
        all_tokens = torch.cat([t for t, _ in per_rank])
        all_weights = torch.cat([w for _, w in per_rank])
        # The concatenated loss is the mean over ranks of the ranks' losses (÷ world: exact
        # for a power of two), the objective whose gradient DP averages.
        ctls["dp"].step(lambda: (models["dp"](tokens) * weights).sum())
        ctls["alone"].step(lambda: (models["alone"](tokens) * weights).sum())
        ctls["concatenated"].step(lambda: (models["concatenated"](all_tokens) * all_weights).sum() / world)
    reference = _params(models["concatenated"])
    return {f"{run}_vs_concatenated": max(int(ulp_distance(p, reference[name]).abs().max())
                                          for name, p in _params(models[run]).items())
            for run in ("dp", "alone")}


def split_batch_deviation(problem: ChunkProblem, rule, chunks, split, steps):
    """Job: each rank steps its own sequence of the problem's batches (batch = world size);
    returns {"digest": the parameters' bits, "max_ulp", "relative"}: the DP run against one
    process stepping the whole batch (``relative``: ‖Δ‖ / ‖the reference's change‖)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if problem.batch != world:
        raise ValueError(f"split_batch_deviation gives each of the {world} ranks one sequence: batch must be {world}")
    batches = problem.batches(steps)
    dp_model, whole_model = problem.model(), problem.model()
    start = _params(whole_model)
    dp = fk.ChunkFT(dp_model, copy.deepcopy(rule), chunks, split=split, process_group=dist.group.WORLD)
    whole = fk.ChunkFT(whole_model, copy.deepcopy(rule), chunks, split=split)
    for tokens, targets in batches:
        dp.step(lambda: _loss(dp_model, tokens[rank:rank + 1], targets[rank:rank + 1], problem.vocab))
        whole.step(lambda: _loss(whole_model, tokens, targets, problem.vocab))
    a, b = _params(dp_model), _params(whole_model)
    change = torch.cat([(b[n] - start[n]).flatten() for n in b]).norm()
    return {"digest": [int_view(p).tolist() for p in a.values()],
            "max_ulp": max(int(ulp_distance(a[n], b[n]).abs().max()) for n in a),
            "relative": float(torch.cat([(a[n] - b[n]).flatten() for n in a]).norm() / change)}


def _refusal(build):
    """The error ``build()`` raised on this rank (None: it was accepted)."""
    try:
        build()
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def differing_setups_are_refused():
    """Job: controllers that differ between the ranks in one respect each; returns
    {case: the error this rank raised, or None}. Every rank must refuse each (none may
    hang in a collective or be left waiting by a peer that refused alone):

    * "chunks", "lr", "weight_decay", "rounding": the configuration;
    * "weights": another seed; "permuted": two embedding rows swapped on rank 1 (the same
      multiset of bits, in other places);
    * "local": rank 1's model has a float64 norm weight, which it refuses before any
      collective."""
    rank = dist.get_rank()

    def model(seed=0):
        return ChunkProblem(vocab=5, width=4, hidden=4, batch=1, length=2, seed=seed).model()

    def controller(net=None, rule=None, chunks=2, **options):
        return fk.ChunkFT(model() if net is None else net, rule or fk.SGD(lr=0.1), chunks,
                          process_group=dist.group.WORLD, **options)

    permuted, local = model(), model()
    with torch.no_grad():
        if rank == 1:
            permuted.embed.weight[[1, 2]] = permuted.embed.weight[[2, 1]].clone()
            local.rms.weight.data = local.rms.weight.data.double()
    cases = {"chunks": lambda: controller(chunks=2 + rank),
             "lr": lambda: controller(rule=fk.AdamW(lr=1e-2 * (rank + 1))),
             "weight_decay": lambda: controller(rule=fk.AdamW(lr=1e-2, weight_decay=0.1 * rank)),
             "rounding": lambda: controller(rounding=("stochastic", "nearest")[rank]),
             "weights": lambda: controller(model(seed=rank)),
             "permuted": lambda: controller(permuted),
             "local": lambda: controller(local)}
    return {case: _refusal(build) for case, build in cases.items()}


class _TensorParallel(nn.Module):
    """This rank's part of ``ColumnThenRow`` (no down bias): up's rows (input copied to the
    parallel region, its gradient all-reduced) and down's columns (partial outputs
    all-reduced). The inputs arrive whole; down takes this rank's columns of its input."""

    def __init__(self, whole, rows):
        super().__init__()
        r0, r1 = rows
        self.rows = rows
        self.up = nn.Linear(whole.up.in_features, r1 - r0)
        self.down = nn.Linear(r1 - r0, whole.down.out_features, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(whole.up.weight[r0:r1])
            self.up.bias.copy_(whole.up.bias[r0:r1])
            self.down.weight.copy_(whole.down.weight[:, r0:r1])

    def forward(self, x_up, x_down):
        from forge_kernels.parallel_linear import _CopyToParallelRegion, _ReduceFromParallelRegion
        group = dist.group.WORLD
        r0, r1 = self.rows
        up = self.up(_CopyToParallelRegion.apply(x_up, group))
        return up, _ReduceFromParallelRegion.apply(self.down(x_down[:, r0:r1]), group)


def tp_layers_are_slices_of_unsharded(rule, regime, split, chunks, inputs=5, hidden=7, outputs=4, tokens=3, seed=0):
    """Job: 2·chunks steps of the tensor-parallel layers and of the unsharded ones on
    every rank; raises at the first local weight not bitwise the unsharded slice."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(seed)
    whole = ColumnThenRow(inputs, hidden, outputs, down_bias=False).to(regime.weight)
    r0, r1 = bounds(hidden, world, rank)
    local = _TensorParallel(whole, (r0, r1)).to(regime.weight)
    shards = {"up.weight": fk.WeightSlice(r0, 0, (hidden, inputs)), "up.bias": fk.WeightSlice(0, r0, (1, hidden)),
              "down.weight": fk.WeightSlice(0, r0, (outputs, hidden))}
    options = dict(split=split, seed=regime.seed, state_format=regime.state_format, rounding=regime.rounding)
    local_ctl = fk.ChunkFT(local, copy.deepcopy(rule), chunks, shards=shards, **options)
    whole_ctl = fk.ChunkFT(whole, copy.deepcopy(rule), chunks, **options)
    gen = torch.Generator().manual_seed(seed + 1)
    draw = lambda *shape: torch.randn(*shape, generator=gen).to(regime.weight)  # noqa: E731
    for t in range(2 * chunks):
        x_up, g_up, x_down, g_down = draw(tokens, inputs), draw(tokens, hidden), draw(tokens, hidden), draw(
            tokens, outputs)

        def local_loss():
            up, down = local(x_up, x_down)
            return (up * g_up[:, r0:r1]).sum() + (down * g_down).sum()

        def whole_loss():
            up, down = whole(x_up, x_down)
            return (up * g_up).sum() + (down * g_down).sum()
        local_ctl.step(local_loss)
        whole_ctl.step(whole_loss)
        what = f"rank {rank}, step {t} [{rule!r}; {regime.describe()}; split={split}; rows/cols {r0}:{r1}]"
        assert_bitwise_equal(local.up.weight.detach(), whole.up.weight.detach()[r0:r1], f"{what}: up.weight")
        assert_bitwise_equal(local.up.bias.detach(), whole.up.bias.detach()[r0:r1], f"{what}: up.bias")
        assert_bitwise_equal(local.down.weight.detach(), whole.down.weight.detach()[:, r0:r1], f"{what}: down.weight")
