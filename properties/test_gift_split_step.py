"""GIFT on FORGE's materialized data-parallel path (``materialized_split_step(...,
reduce=fk.gift.GiftSplitReducer(...))``, jobs in
``forge_verify/distributed/gift_split_jobs.py``), on 2 gloo ranks: with the identity codec
the step is the fp32 all-reduce's bit for bit on exactly representable data; with E4M3
every bucket's sum is within the bound derived in proofs/gift.md ("6. A summed
exchange", and 7 for the reduce-scatter exchange's second quantization). The ranks' sums are compared for equality: each rank applies T^{-1} (a matrix
product) itself, which gives equal bits because both ranks share this machine's BLAS and
thread count."""

import pytest

from forge_verify.distributed import gift_split_jobs
from forge_verify.numerics.bits import assert_bitwise_equal

pytestmark = [pytest.mark.distributed]


@pytest.mark.exactness
@pytest.mark.parametrize("exchange", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("transform", ["none", "identity"])
def test_identity_codec_step_equals_the_all_reduce_step(transform, exchange, rank_pool):
    for wire, received in rank_pool(2).run(gift_split_jobs.identity_codec_equals_all_reduce, transform, exchange):
        # 24 rows × 32 features in buckets of 8: three exchanges of 8 × 32 fp32 values, and
        # one 3-value amax vector each that the identity codec does not all-reduce; the
        # reduce-scatter passes the bucket into the all-to-all and half of it, its sum,
        # into the all-gather, and receives the other rank's halves of both
        if exchange == "all_gather":
            assert wire == {"gradients": 3 * 8 * 32 * 4} and received == wire, (wire, received)
        else:
            assert wire == {"gradients": 3 * (8 * 32 + 4 * 32) * 4}, wire
            assert received == {"gradients": 3 * 8 * 32 * 4}, received


@pytest.mark.parametrize("exchange", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("route", ["plain", "gift"])
def test_e4m3_bucket_sums_stay_within_the_derived_bound(route, exchange, rank_pool):
    results = rank_pool(2).run(gift_split_jobs.e4m3_sums_within_the_bound, route, exchange)
    assert results[0] == results[1]  # every rank holds the same sums, errors, bounds and byte counts
    measured, wire, received = results[0]
    assert len(measured) == 3
    for error, bound, norm in measured:
        assert 0 < error <= bound, (error, bound)
        # the bound says something: E4M3's 2⁻⁴ per rank, × κ (reduce-scatter: a second 2⁻⁴ of the sum)
        assert bound <= {"all_gather": 0.2, "reduce_scatter": 0.35}[exchange] * norm, (bound, norm)
    # counted: three buckets of 8 × 32 one-byte codes, each with its amax and non-finite
    # flag (2 fp32); a refresh passes a flag, A (32 × 32 fp32), the rank and the factors
    # (U 32 × 8 and d_apply, d_invert, 1/σ, σ in fp32; 8 + 1 float64 scales)
    expected = {"gradients": 3 * 8 * 32, "scales": 3 * 2 * 4}
    if exchange == "reduce_scatter":  # the all-gather of the half-bucket sums, their amax and flag
        expected = {"gradients": 3 * (8 * 32 + 4 * 32), "scales": 3 * 2 * 2 * 4}
    assert received == {"gradients": 3 * 8 * 32}, received  # at 2 ranks both exchanges receive a bucket
    if route == "gift":
        expected["refresh"] = 8 + 32 * 32 * 4 + 8 + (32 * 8 + 8 + 8 + 1 + 1) * 4 + 9 * 8
    assert wire == expected, wire


@pytest.mark.exactness
def test_a_resumed_reducer_continues_bit_for_bit(rank_pool):
    """Residuals per bucket and the transform survive state_dict/load_state_dict: 4 AdamW
    steps with error feedback, the reducer replaced by a loaded copy after 2."""
    for rank, (whole, resumed) in enumerate(rank_pool(2).run(gift_split_jobs.resumed_reducer_continues)):
        assert_bitwise_equal(whole, resumed, f"rank {rank}")
