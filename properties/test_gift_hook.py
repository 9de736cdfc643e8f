"""GIFT's DDP communication hook on real gloo process groups (jobs in
``forge_verify/distributed/gift_jobs.py``): with the identity transform and codec it is
DDP's all-reduce averaging bit for bit on exactly representable data; E4M3 codes with the
agreed scale sum exactly; the factors hash equal on every rank after every refresh and
the parameters stay identical; error feedback loses nothing, across a refresh
(proofs/gift.md, "Error feedback"). The reduce-scatter exchange (the default): with the
identity codec it is the rank-order fp32 sum over the world size, bit for bit; each
format's result is within the second quantization's bound (proofs/gift.md, section 7)
of the mean of what the ranks sent, equal on every rank; it receives 2 (n − 1)/n of the
code bytes; its two residuals together lose nothing; a sum that overflows is refused on
every rank."""

import math

import pytest
import torch

import forge_kernels as fk
from forge_verify.distributed import gift_jobs
from forge_verify.numerics.bits import assert_bitwise_equal
from forge_verify.numerics.gift_bounds import reduce_scatter_element_bound

pytestmark = [pytest.mark.distributed, pytest.mark.exactness]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("unselected, bucket_cap_mb", [("plain", 25.0), ("fp32", 25.0), ("plain", 0.001)])
def test_identity_hook_equals_all_reduce_averaging(world, unselected, bucket_cap_mb, rank_pool):
    for rank, pairs in enumerate(rank_pool(world).run(gift_jobs.hook_versus_all_reduce, 7, unselected,
                                                      bucket_cap_mb)):
        for i, (hooked, averaged) in enumerate(pairs):
            assert_bitwise_equal(hooked, averaged, f"rank {rank}, gradient {i}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("route", ["plain", "gift"])
def test_e4m3_exchange_with_the_agreed_scale_equals_all_reduce(world, route, rank_pool):
    for rank, (out, expected) in enumerate(rank_pool(world).run(gift_jobs.e4m3_exchange_versus_all_reduce, 3, route)):
        assert_bitwise_equal(out, expected, f"rank {rank}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "nvfp4"])
@pytest.mark.parametrize("route, shape", [("plain", (5, 48)), ("plain", (37,)), ("gift", (3, 64))])
def test_exchange_averages_what_every_rank_sent(world, fmt, route, shape, rank_pool):
    """Every rank's result is the mean of all ranks' locally decoded values (the ranks'
    amaxes differ by 2**3 per rank; the scale is agreed), up to the fp32 rounding of
    summing them: |out − mean| ≤ world · 2**-24 · mean |sent| per element."""
    for rank, (outs, everyone) in enumerate(rank_pool(world).run(gift_jobs.exchange_versus_local_decodes, 9, fmt,
                                                                  route, shape)):
        for out, sent in zip(outs, everyone):
            stacked = torch.stack(sent).double()
            error = (out.double() - stacked.mean(dim=0)).abs()
            assert bool((error <= world * 2.0 ** -24 * stacked.abs().mean(dim=0)).all()), (rank, float(error.max()))


@pytest.mark.parametrize("exchange", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("fmt, route", [("e4m3", "plain"), ("e5m2", "plain"), ("nvfp4", "plain"), ("e4m3", "gift")])
def test_a_gradient_that_stays_zero_never_turns_nan(fmt, route, exchange, rank_pool):
    """A branch gated off after step 0 sends exact zeros from then on, plus its residual,
    which shrinks about 30-fold a step under error feedback: around step 20 its amax fell below
    448 / FLT_MAX, the scale max / amax overflowed to inf and 0 · inf made NaN codes (NaN
    in the weights on the all-gather, a refused "overflowed" sum on the reduce-scatter).
    40 steps: finite throughout, the residual decayed to fp32's smallest values."""
    for rank, (step, error, residual) in enumerate(rank_pool(2).run(gift_jobs.gated_branch_training, 3, fmt,
                                                                    exchange, route, 40)):
        assert step is None and error is None, (rank, step, error)
        assert residual < 448 / torch.finfo(torch.float32).max, (rank, residual)  # the clamped regime was reached


@pytest.mark.parametrize("world, fmt", [(2, "e4m3"), (2, "nvfp4"), (4, "e5m2")])
def test_factors_and_parameters_identical_on_every_rank(world, fmt, rank_pool):
    """Every rank is given another damping, so its own factors would differ from the first
    rank's (they did when review replaced ``Whitening.broadcast`` by a no-op while every rank
    still computed them; now the other ranks hold zeros until the broadcast)."""
    results = rank_pool(world).run(gift_jobs.gift_training_digests, 11, fmt, 7, 3)
    factor_digests, parameter_digests = results[0]
    assert [step for step, _, _ in factor_digests] == [0, 0, 3, 3, 6, 6]  # two layers, steps 0, 3, 6
    assert len({digest for _, _, digest in factor_digests}) == 6  # every refresh made new factors
    for rank, (factors, parameters) in enumerate(results[1:], start=1):
        assert factors == factor_digests, f"rank {rank}'s factors differ"
        assert parameters == parameter_digests, f"rank {rank}'s parameters differ"


@pytest.mark.parametrize("world", [2, 4])
def test_factors_are_computed_on_the_first_rank_only(world, rank_pool):
    """One float64 eigendecomposition per refresh, on the group's first rank; the others
    receive its factors (equal digests, though every rank's covariance was its own)."""
    results = rank_pool(world).run(gift_jobs.factor_computations, 7)
    assert [calls for calls, _ in results] == [1] + [0] * (world - 1), results
    assert len({digest for _, digest in results}) == 1


def test_a_transform_the_first_rank_cannot_compute_is_refused_on_every_rank(rank_pool):
    """The source alone computes the factors, so it alone can fail; it tells the others
    (a rank of -1) before raising, so that none waits for factors that never come."""
    source, other = rank_pool(2).run(gift_jobs.singular_transform)
    assert source is not None and "discarded eigenvalues are all zero" in source, source
    assert other is not None and "first rank (0) could not compute" in other, other


@pytest.mark.stats
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "nvfp4"])
@pytest.mark.parametrize("exchange", ["all_gather", "reduce_scatter"])
def test_the_gain_survives_the_hook(world, fmt, exchange, rank_pool):
    """Through the hook (shared scales, all-gather, fp32 sums, factors from the
    all-reduced window), on gradients in the top-32 activation subspace of K = 1024: the
    averaged result errs ≤ 1/3 of the plain route's (proofs/gift.md predicts ≈ 0.18)."""
    pool = rank_pool(world)
    plain = pool.run(gift_jobs.hook_gain, 21, fmt, "plain", exchange)
    gift = pool.run(gift_jobs.hook_gain, 21, fmt, "gift", exchange)
    assert len(set(plain)) == 1 and len(set(gift)) == 1  # every rank holds the same result
    assert gift[0] <= plain[0] / 3, (plain[0], gift[0])


def test_error_feedback_loses_nothing_across_a_refresh(rank_pool):
    for rank, (accounted, given, sigmas) in enumerate(rank_pool(2).run(gift_jobs.error_feedback_ledger, 5, 6,
                                                                       {0: 3, 3: 5})):
        assert sigmas == [2.0, 2.0, 2.0, 8.0, 8.0, 8.0]  # T = I/2, then I/8
        assert_bitwise_equal(accounted, given, f"rank {rank}")


def test_state_refuses_what_it_cannot_do():
    layer = torch.nn.Linear(4, 4)
    for kwargs in ({"fmt": "e3m4"}, {"fmt": "nvfp4", "scaling": "power_of_two"}, {"unselected": "bf16"},
                   {"transform": "random"}, {"refresh_every": 0}):
        arguments = {"process_group": None, "fmt": "e4m3", "layers": [layer], **kwargs}
        with pytest.raises(ValueError):
            fk.gift.GiftState(**arguments)
    # at construction, not at the first refresh inside DDP's backward (where NaN damping made
    # NaN factors and the error blamed the gradient)
    for kwargs in ({"rank": 32.0}, {"rank": -1}, {"rank": True}, {"damping": -1.0}, {"damping": math.nan},
                   {"damping": math.inf}, {"damping": "1e-3"}):
        with pytest.raises(ValueError, match=f"{next(iter(kwargs))} must be"):
            fk.gift.GiftState(None, "e4m3", layers=[layer], **kwargs)
    with pytest.raises(TypeError):
        fk.gift.GiftState(None, "e4m3", layers=[torch.nn.Conv1d(4, 4, 1)])


SHAPES = [("plain", (5, 48)), ("plain", (37,)), ("gift", (3, 64))]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("route", ["plain", "gift"])
def test_identity_reduce_scatter_is_the_rank_order_sum_over_the_world(world, route, rank_pool):
    """fp32 through the all-to-all, the shard sums and the all-gather of the sums: bit for
    bit fl(fl(… fl(x_0 + x_1) … + x_{n−1}) / n) per element, the left-to-right sum in
    rank order (Gaussian data, so the order matters), on every rank, and again on a
    fresh state. (On integer data it is DDP's all-reduce averaging too:
    ``test_identity_hook_equals_all_reduce_averaging`` runs the default exchange.)"""
    shapes = [(5, 48), (37,), (3, 64)] if route == "plain" else [(3, 64), (7, 16)]
    results = rank_pool(world).run(gift_jobs.identity_reduce_scatter_versus_rank_order_sum, 13, route, shapes)
    for rank, (outs, references, again) in enumerate(results):
        for i, (out, reference, repeated) in enumerate(zip(outs, references, again)):
            assert_bitwise_equal(out, reference, f"rank {rank}, tensor {i}")
            assert_bitwise_equal(out, repeated, f"rank {rank}, tensor {i}, repeated")
            assert_bitwise_equal(out, results[0][0][i], f"rank {rank} against rank 0, tensor {i}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "nvfp4"])
@pytest.mark.parametrize("route, shape", SHAPES)
def test_reduce_scatter_stays_within_the_second_quantizations_bound(world, fmt, route, shape, rank_pool):
    """The ranks' amaxes differ by 2**3 per rank, so shard sums span a wide range: every
    rank's result is bit for bit rank 0's, and per element |n · out − Σ_r ŷ_r| ≤ the bound of
    ``reduce_scatter_element_bound`` (ŷ_r: what rank r decoded locally). The bound is
    not vacuous: on every tensor of 16 elements or more the error reaches 5 % of it somewhere."""
    results = rank_pool(world).run(gift_jobs.exchange_versus_local_decodes, 9, fmt, route, shape, "reduce_scatter")
    for rank, (outs, everyone) in enumerate(results):
        for i, (out, sent) in enumerate(zip(outs, everyone)):
            assert_bitwise_equal(out, results[0][0][i], f"rank {rank} against rank 0, tensor {i}")
            stacked = torch.stack(sent).double()
            error = (world * out.double() - stacked.sum(dim=0)).abs()
            bound = reduce_scatter_element_bound(fmt, stacked.sum(dim=0), stacked.abs().sum(dim=0), world)
            assert bool((error <= bound).all()), (rank, i, float((error - bound).max()))
            if out.numel() >= 16:  # not vacuous (a lone element is its own amax and lands on the max code)
                assert float((error / bound.clamp(min=1e-30)).max()) > 0.05, (rank, i)


def _message_bytes(fmt, numels, world):
    """What a rank sends each rank: every tensor's units padded to a multiple of the world, one shard each."""
    unit, unit_bytes = {"e4m3": (1, 1), "nvfp4": (16, 9), "fp32": (1, 4)}[fmt]
    return sum(-(-(-(-n // unit)) // world) for n in numels) * unit_bytes


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fmt", ["e4m3", "nvfp4", "fp32"])
def test_reduce_scatter_receives_two_world_minus_one_over_world_of_the_codes(world, fmt, rank_pool):
    """Tensors of 37, 100 and 5 elements (NVFP4: 3, 7 and 1 blocks, each padded to a
    multiple of the world): the counters against the formulas, 2 (n − 1)/n of the padded
    payload P' received against the all-gather's (n − 1) P, P' − P under world − 1 units
    per tensor."""
    numels = (37, 100, 5)
    pool = rank_pool(world)
    shard = _message_bytes(fmt, numels, world)
    payload = sum({"e4m3": n, "nvfp4": -(-n // 16) * 9, "fp32": 4 * n}[fmt] for n in numels)
    scales = {} if fmt == "fp32" else {"scales": (len(numels) + 1) * 4}
    for wire, received in pool.run(gift_jobs.exchange_bytes, fmt, "reduce_scatter", numels):
        assert received == {"gradients": 2 * (world - 1) * shard}, received
        assert wire == {"gradients": world * shard + shard, **{k: 2 * v for k, v in scales.items()}}, wire
        unit_bytes = {"e4m3": 1, "nvfp4": 9, "fp32": 4}[fmt]
        assert 0 <= world * shard - payload <= len(numels) * (world - 1) * unit_bytes
    for wire, received in pool.run(gift_jobs.exchange_bytes, fmt, "all_gather", numels):
        assert received == {"gradients": (world - 1) * payload}, received
        assert wire == {"gradients": payload, **scales}, wire


@pytest.mark.exactness
@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_error_feedback_loses_nothing_across_a_refresh(world, rank_pool):
    """Σ_t n · out_t + Σ_r (first + shard residual of r) = Σ_t Σ_r G_r exactly (dyadic data,
    power-of-two scales and transforms), with a refresh at step 3 that folds the shard
    residuals into the first ones; some shard residual was nonzero before it and at the end."""
    for rank, (accounted, given, held) in enumerate(rank_pool(world).run(gift_jobs.reduce_scatter_ledger, 5, 6,
                                                                          {0: 3, 3: 5})):
        assert held == [False, True, True], held  # none at step 0, some before the refresh and at the end
        assert_bitwise_equal(accounted, given, f"rank {rank}")


def test_power_of_two_scaling_stays_within_its_second_quantization_bound(rank_pool):
    """A shard sum of 480 and 3 · 2**-9: under power-of-two scaling the second scale is
    half of current scaling's, so the small element's subnormal error is twice as large.
    It stays within the bound for that scaling (and exceeds the current-scaling bound,
    which shows the case is the one that needs the factor)."""
    rows = [[240.0, 2.0 ** -9] + [0.0] * 14, [240.0, 2.0 ** -8] + [0.0] * 14]
    for rank, (out, everyone) in enumerate(rank_pool(2).run(gift_jobs.power_of_two_requantization, rows)):
        stacked = torch.stack(everyone).double()
        error = (2 * out.double() - stacked.sum(dim=0)).abs()
        bound = reduce_scatter_element_bound("e4m3", stacked.sum(dim=0), stacked.abs().sum(dim=0), 2,
                                             scaling="power_of_two")
        assert bool((error <= bound).all()), (rank, float((error - bound).max()))
        current = reduce_scatter_element_bound("e4m3", stacked.sum(dim=0), stacked.abs().sum(dim=0), 2)
        assert bool((error > current).any()), rank


@pytest.mark.parametrize("world", [2, 4])
def test_a_reduce_scatter_state_resumed_on_the_all_gather_loses_nothing(world, rank_pool):
    """Saved after 3 reduce-scatter steps (shard residuals held), loaded into an
    all-gather hook, 3 more steps: the ledger still closes exactly, and no shard residual
    is left unsent at the end (the all-gather folds them into the first residuals)."""
    for rank, (accounted, given, held) in enumerate(rank_pool(world).run(gift_jobs.reduce_scatter_ledger, 5, 6,
                                                                          {0: 3}, 3)):
        assert held == [False], held  # none at step 0, none left at the end
        assert_bitwise_equal(accounted, given, f"rank {rank}")


def test_the_identity_codec_keeps_no_residual_from_an_overflowed_sum(rank_pool):
    """Its second step is exact, so it keeps no shard residual: an inf - inf residual from
    an overflowed sum would make that element NaN at every later step."""
    for rank, (finite, shards) in enumerate(rank_pool(2).run(gift_jobs.identity_overflow_then_finite, 6)):
        assert finite and shards == [], (rank, finite, shards)


def test_an_overflowing_shard_sum_is_refused_on_every_rank(rank_pool):
    for rank, (message, residuals, shards) in enumerate(rank_pool(2).run(gift_jobs.overflowing_shard_sum, 4)):
        assert message is not None and "overflowed fp32 on at least one rank" in message, (rank, message)
        assert residuals == [] and shards == [], rank
