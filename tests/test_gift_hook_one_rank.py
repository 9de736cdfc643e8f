"""GIFT's hook in one rank's process group, on the default backend: NCCL on a GPU (CUDA
gradients; the codec on the GPU; uint8 codes through NCCL's all-gather and all-to-all;
``overlap=False``), gloo on the CPU. With one rank the exchange must be the codec's own
round trip: the identity codec gives DDP's averaged gradient bit for bit, E4M3 and NVFP4
give ``fk.gift.round_trip`` of it bit for bit (through the layer's transform on the GIFT route) (first step: no residual yet; one rank's
amax is the agreed one), on both exchanges (the reduce-scatter's second quantization
re-encodes a grid value under the same scale: a fixed point, up to NVFP4's sign of zero,
which TE's E2M1 rounding drops from -0.0). The multi-rank hook
properties need as many GPUs as ranks under NCCL; this is what one GPU can check."""

import pytest

from forge_verify.distributed import gift_jobs
from forge_verify.distributed.ranks import RankPool
from forge_verify.numerics.bits import assert_bitwise_equal


@pytest.fixture(scope="module")
def one_rank():
    with RankPool(1) as pool:
        yield pool


@pytest.mark.parametrize("route", ["plain", "gift"])
@pytest.mark.parametrize("exchange", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("fmt", ["fp32", "e4m3", "nvfp4"])
def test_one_rank_exchange_is_the_codecs_round_trip(one_rank, fmt, exchange, route):
    """On the GIFT route (the first Linear, its whitening computed from the step's inputs,
    through the covariance all-reduce and the factors' broadcast) the expected result is
    T^{-1}(round trip(G T))."""
    (triples,) = one_rank.run(gift_jobs.hook_on_the_pools_device, 5, fmt, exchange, route)
    for i, (hooked, averaged, round_trip) in enumerate(triples):
        assert averaged.abs().max() > 0, i  # a gradient that moves, so the codec has work
        assert_bitwise_equal(hooked, round_trip, f"{fmt} {exchange}, parameter {i}")
