"""GIFT's hook is asynchronous (``GiftState(overlap=True)``, which the default, None,
chooses on gloo with CPU gradients, as here): it returns a future before the collectives
complete, the reduction runs on the state's communication thread, and the bits are those
of reducing inside the hook (``overlap=False``). A
non-finite gradient on one rank makes every rank refuse together. A hook saved with
``state_dict`` and loaded into a fresh one continues bit for bit. Jobs in
``forge_verify/distributed/gift_selection_jobs.py``; 2 gloo ranks."""

import pytest

from forge_verify.distributed import gift_selection_jobs
from forge_verify.numerics.bits import assert_bitwise_equal

pytestmark = [pytest.mark.distributed]

#: rank 1 starts its backward this late; compute on rank 0 takes milliseconds, so a hook
#: that waited on the collectives would take about this long to return
DELAY_S = 2.0


@pytest.mark.exactness
@pytest.mark.parametrize("fmt, bucket_cap_mb", [("e4m3", 25.0), ("nvfp4", 0.001), ("e5m2", 0.001)])
def test_overlapped_reduction_equals_the_inline_one_bit_for_bit(fmt, bucket_cap_mb, rank_pool):
    assert rank_pool(2).run(gift_selection_jobs.overlap_versus_inline, 17, fmt, 5, bucket_cap_mb) == [True, True]


def test_the_hook_returns_before_its_collectives_complete(rank_pool):
    pool = rank_pool(2)
    overlapped = pool.run(gift_selection_jobs.hook_returns_before_the_peer_arrives, 3, DELAY_S, True)[0]
    inline = pool.run(gift_selection_jobs.hook_returns_before_the_peer_arrives, 3, DELAY_S, False)[0]
    assert len(overlapped) == len(inline) >= 2  # several buckets in flight
    assert all(seconds < DELAY_S / 4 and not done for seconds, done in overlapped), overlapped
    # the control: reducing inside the hook waits for the late peer on the first bucket
    assert inline[0][0] > DELAY_S / 2 and all(done for _, done in inline), inline


@pytest.mark.parametrize("exchange", ["all_gather", "reduce_scatter"])
def test_a_non_finite_gradient_on_one_rank_is_refused_on_every_rank(exchange, rank_pool):
    for rank, (message, residuals) in enumerate(rank_pool(2).run(gift_selection_jobs.non_finite_on_one_rank, 4,
                                                                 exchange)):
        assert message is not None and "not finite on at least one rank" in message, (rank, message)
        assert residuals == [], rank


@pytest.mark.exactness
@pytest.mark.parametrize("fmt, select, exchange", [("e4m3", False, "reduce_scatter"), ("nvfp4", False, "reduce_scatter"),
                                                   ("e4m3", True, "reduce_scatter"), ("e4m3", False, "all_gather")])
def test_a_resumed_hook_continues_bit_for_bit(fmt, select, exchange, rank_pool):
    """Saved after 5 steps (the covariance window holding steps since the last refresh,
    residuals set, on the reduce-scatter exchange the owned shards' second residuals too),
    loaded into a fresh hook, 3 more steps (a refresh among them): the uninterrupted run's
    bits. (The fresh DDP hands the parameters over in another order at its first step than
    the uninterrupted one does by then: the shards must not depend on that order.)"""
    for rank, (whole, resumed, digests, resumed_digests) in enumerate(
            rank_pool(2).run(gift_selection_jobs.resume_versus_uninterrupted, 19, fmt, 5, 3, select, exchange)):
        for i, (a, b) in enumerate(zip(whole, resumed)):
            assert_bitwise_equal(a, b, f"rank {rank}, parameter {i}")
        # refreshes: both layers at steps 0, 3, 6; or the one selected at the window's end
        # (step 2) and at 5. The resumed hook made those from step 5 on itself.
        assert sorted(step for step, _, _ in digests) == ([2, 5] if select else [0, 0, 3, 3, 6, 6]), digests
        assert digests == resumed_digests, rank
