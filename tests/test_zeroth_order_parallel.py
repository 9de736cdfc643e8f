"""GRZO and MeZO under data parallelism (2 gloo ranks, b = B/2 examples each) give the
single-process step with B bit for bit, and a refusal on one rank is a refusal on both.

The model (``BatchInvariantModel``) computes each example's loss with the same bits
whatever else is in its batch, provably (its docstring says why), so what is compared
is the optimizers' own data-parallel part: the global example index of each rank's
draws, the exchange of the losses, the update from all B of them."""

import re

import pytest
import torch

from forge_verify.checks.zeroth_order import batch_invariant_data, zeroth_order_steps
from forge_verify.distributed import zeroth_order_jobs as jobs
from forge_verify.numerics.bits import assert_bitwise_equal

pytestmark = pytest.mark.distributed

BATCH, STEPS, WORLD = 4, 3, 2


@pytest.mark.exactness
@pytest.mark.parametrize("method", ["GRZO", "MeZO"])
def test_two_data_parallel_ranks_give_the_single_process_step(method, rank_pool):
    """3 steps: both ranks' parameters equal the single process's, bitwise (MeZO: the
    single process's loss is the mean of the two halves' means, as the all-reduce forms it)."""
    single = zeroth_order_steps(method, STEPS, batch_invariant_data(BATCH), sizes=[BATCH // WORLD] * WORLD)
    start = zeroth_order_steps(method, 0, batch_invariant_data(BATCH))
    assert any(not torch.equal(single[n], start[n]) for n in single), "the steps moved nothing"
    for rank, params in enumerate(rank_pool(WORLD).run(jobs.data_parallel_steps, method, STEPS, BATCH)):
        for name, value in single.items():
            assert_bitwise_equal(params[name], value, f"rank {rank} {name}")


@pytest.mark.parametrize("method, fault, error, message", [
    ("GRZO", "nan", "NonFiniteLossError", "no step was taken"),
    ("GRZO", "shape", "RankRefusedError", r"rank\(s\) \[0\]"),
    ("GRZO", "batch", "ValueError", r"unequal local batches \(\[1, 2\]\)"),
    ("MeZO", "nan", "NonFiniteLossError", "no step was taken"),
    ("MeZO", "shape", "RankRefusedError", r"rank\(s\) \[0\]"),
    ("GRZO", "seed", "ValueError", r"disagree on the seed \(\[12, 11\]\)"),
    ("MeZO", "seed", "ValueError", r"disagree on the seed \(\[12, 11\]\)"),
    ("GRZO", "lr", "ValueError", r"disagree on lr \(rank\(s\) \[1\] differ from rank 0"),
    ("MeZO", "lr", "ValueError", r"disagree on lr \(rank\(s\) \[1\] differ from rank 0"),
    ("GRZO", "sigma", "ValueError", r"disagree on sigma \(rank\(s\) \[1\]"),
    ("MeZO", "eps", "ValueError", r"disagree on eps \(rank\(s\) \[1\]"),
    ("GRZO", "normalize", "ValueError", r"disagree on normalize \(rank\(s\) \[1\]"),
    ("MeZO", "weight_decay", "ValueError", r"disagree on weight_decay \(rank\(s\) \[1\]"),
    ("GRZO", "weights", "ValueError", "hold different weights"),
    ("MeZO", "weights", "ValueError", "hold different weights"),
    ("GRZO", "reloaded", "ValueError", "hold different weights"),
    ("MeZO", "reloaded", "ValueError", "hold different weights"),
])
def test_a_refusal_on_one_rank_is_a_refusal_on_every_rank(method, fault, error, message, rank_pool):
    """Rank 0 alone has the fault; rank 1 raises too (no rank is left waiting in a
    collective) and GRZO's parameters are untouched on both (MeZO's restore may drift:
    properties/test_zeroth_order_mezo.py). A hyperparameter or weights that differ used
    to go unnoticed: the ranks stepped apart silently. "reloaded": weights that came
    apart after the first step are seen at the step after a load_state_dict."""
    results = rank_pool(WORLD).run(jobs.refused_everywhere, method, BATCH, fault)
    for rank, (raised, unchanged) in enumerate(results):
        assert raised is not None, f"rank {rank} took the step"
        if not (rank == 0 and fault == "shape"):  # rank 0's own error is its TypeError
            assert raised[0] == error and re.search(message, raised[1]), (rank, raised)
        if method == "GRZO":
            assert unchanged, f"rank {rank} wrote its parameters"


@pytest.mark.exactness
def test_mezo_weighs_each_ranks_mean_loss_alike_whatever_its_local_batch(rank_pool):
    """MeZO's closure returns a scalar, so unequal local batches (rank 0 holds one example
    fewer) cannot be seen, and are not refused as GRZO's are: every rank takes the single
    process's step whose loss is the mean of the two ranks' means (3 and 4 examples
    weighing 1/2 each), bitwise."""
    data = tuple(part[1:] for part in batch_invariant_data(2 * BATCH))
    single = zeroth_order_steps("MeZO", STEPS, data, sizes=[BATCH - 1, BATCH])
    plain = zeroth_order_steps("MeZO", STEPS, data, sizes=[2 * BATCH - 1])
    assert any(not torch.equal(single[n], plain[n]) for n in single), "the weighting changed nothing"
    for rank, params in enumerate(rank_pool(WORLD).run(jobs.unequal_batch_steps, STEPS, 2 * BATCH)):
        for name, value in single.items():
            assert_bitwise_equal(params[name], value, f"rank {rank} {name}")


@pytest.mark.exactness
@pytest.mark.parametrize("method", ["GRZO", "MeZO"])
def test_a_column_parallel_model_on_two_ranks_steps_the_slices_of_the_whole(method, rank_pool):
    """Tensor parallelism inside a model: each rank holds half the rows of a Linear (its
    ``shards`` entry) and the replicated embedding, the local outputs are all-gathered in
    the forward; after 3 steps each rank's shard is the slice of the unsharded model's
    Linear and its embedding the unsharded one, bitwise."""
    whole = jobs.column_parallel_steps(method, STEPS, BATCH, world=1)
    start = jobs.column_parallel_steps(method, 0, BATCH, world=1)
    assert not torch.equal(whole["lin.weight"], start["lin.weight"]), "the steps moved nothing"
    for rank, params in enumerate(rank_pool(WORLD).run(jobs.column_parallel_steps, method, STEPS, BATCH)):
        assert_bitwise_equal(params["lin.weight"], whole["lin.weight"][2 * rank:2 * rank + 2], f"rank {rank} shard")
        assert_bitwise_equal(params["tok.weight"], whole["tok.weight"], f"rank {rank} replicated embedding")
