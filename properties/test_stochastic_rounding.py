"""Stochastic rounding fp32 -> bf16: bit-exact against the Philox reference, exactly
unbiased per value (binomial frequencies against the exact probability), no stagnation,
independent across neighbouring elements and successive streams, and defined on every
special value.

Statistical thresholds are fixed in advance (proofs/stochastic_rounding.md): counts of
up-roundings are binomial exactly when the rounding is correct, so they take the exact
binomial test (scipy's ``binomtest``); the stagnation mean takes Azuma's inequality.
The false-alarm probability is below 1e-8 per test; seeds are fixed, so each run is
deterministic.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import example, given
from hypothesis import strategies as st

import forge_kernels as fk
from forge_kernels.ops.stochastic_round import rn_bf16, rn_bf16_cast
from forge_verify.numerics.bits import assert_bitwise_equal, bf16_bits, bf16_rounding_edges, fp32_from_bits
from forge_verify.numerics.philox import stochastic_round_reference
from forge_verify.numerics.stats import binomial_consistent, stagnation_radius


@pytest.mark.exactness
@given(bits=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300),
       seed=st.integers(0, 2**63 - 1), offset=st.integers(0, 2**31))
def test_matches_philox_reference_bit_for_bit(bits, seed, offset, device):
    x = fp32_from_bits(bits)
    assert_bitwise_equal(fk.stochastic_round(x.to(device), seed, offset).cpu(),
                         stochastic_round_reference(x, seed, offset), "stochastic_round")


@pytest.mark.exactness
def test_every_bf16_value_is_kept_and_every_midpoint_goes_to_a_neighbour(device):
    """Exhaustive over the 65,536 bf16 patterns: a value already in bf16 comes back
    unchanged (NaNs as the quiet NaN of the same sign); a value half-way to the next
    pattern comes back as one of its two neighbours."""
    patterns = np.arange(2**16, dtype=np.uint32)
    exact = fp32_from_bits(patterns << 16)
    out = bf16_bits(fk.stochastic_round(exact.to(device), seed=3))
    is_nan = torch.isnan(exact).numpy()
    expected = np.where(is_nan, (patterns & 0x8000) | 0x7FC0, patterns)
    assert np.array_equal(out, expected)

    finite = ~is_nan & (((patterns >> 7) & 0xFF) != 0xFF)
    halfway = fp32_from_bits((patterns << 16) | 0x8000)
    out = bf16_bits(fk.stochastic_round(halfway.to(device), seed=4))
    assert np.all(((out == patterns) | (out == patterns + 1))[finite])
    # Both neighbours occur: each is taken with probability exactly 1/2.
    up = int(np.sum((out == patterns + 1)[finite]))
    assert binomial_consistent(up, int(finite.sum()), 0.5, 1e-9), (up, int(finite.sum()))


@pytest.mark.stats
def test_round_up_frequency_matches_exact_probability(device):
    """For 64 values with known discarded fractions f / 2**16, the count of 2**16
    samples rounded away from zero passes the exact binomial test against f / 2**16
    (each value at 1e-9 / 64): at f = 1 that allows at most 13 up-roundings in 65,536,
    where a Hoeffding radius would allow 916."""
    rng = np.random.default_rng(0)
    fractions = np.concatenate([[1, 2**15, 2**16 - 1], rng.integers(0, 2**16, 61)]).astype(np.uint32)
    # Any sign and exponent, finite, and not the largest finite magnitude (whose up-rounding is inf).
    heads = rng.integers(0, 2**16, 4 * fractions.size).astype(np.uint32)
    heads = heads[((heads & 0x7F80) != 0x7F80) & ((heads & 0x7FFF) != 0x7F7F)][:fractions.size]
    samples = 2**16
    values = fp32_from_bits(np.repeat((heads << 16) | fractions, samples))
    out = bf16_bits(fk.stochastic_round(values.to(device), seed=11)).reshape(fractions.size, samples)
    up = (out == (heads + 1)[:, None]).sum(axis=1)
    stay = (out == heads[:, None]).sum(axis=1)
    assert np.all(up + stay == samples)
    rejected = [(int(f), int(k)) for f, k in zip(fractions, up)
                if not binomial_consistent(int(k), samples, int(f) / 2**16, 1e-9 / fractions.size)]
    assert not rejected, f"(fraction * 2**16, up-roundings of {samples}) failing the exact binomial test: {rejected}"


@pytest.mark.stats
def test_no_stagnation(device):
    """Add 1e-3 to 1.0 a thousand times, storing bf16 each time: round-to-nearest never
    moves (1e-3 is under half an ulp of 1.0); stochastic rounding averages 2.0 over 4,096
    chains. Each step moves a chain by less than one bf16 ulp below 4 (2**-6) from its
    expectation, so the mean is a martingale with differences at most 2**-6 / chains:
    Azuma's radius (false alarm 1e-9), plus 2e-4 for the fp32 additions' rounding
    (1000 steps of at most 2**-23 each, and 1e-3 itself rounded to fp32)."""
    chains, steps = 4096, 1000
    nearest = torch.ones(chains, dtype=torch.bfloat16)
    stochastic = torch.ones(chains, dtype=torch.bfloat16, device=device)
    for step in range(steps):
        nearest = (nearest.float() + 1e-3).bfloat16()
        stochastic = fk.stochastic_round(stochastic.float() + 1e-3, seed=1234, offset=step * chains)
    assert torch.all(nearest == 1.0)
    mean = stochastic.float().mean().item()
    radius = stagnation_radius(steps, chains, 1e-9)
    assert abs(mean - 2.0) <= radius, (mean, radius)


@pytest.mark.stats
def test_neighbours_and_successive_streams_are_uncorrelated(device):
    """Up-rounding indicators of a value with probability 1/2: over disjoint pairs, the
    count of pairs rounded up together passes the exact binomial test against 1/4, for
    adjacent elements and for the same element under successive seeds (as successive
    steps use); the count of single up-roundings against 1/2."""
    n = 2**16
    half = fp32_from_bits(np.full(n, (0x3F80 << 16) | 0x8000, dtype=np.uint32)).to(device)
    first = bf16_bits(fk.stochastic_round(half, seed=99)) == 0x3F81
    second = bf16_bits(fk.stochastic_round(half, seed=100)) == 0x3F81
    together_adjacent = int(np.sum(first[0::2] & first[1::2]))
    together_successive = int(np.sum(first[0::2] & second[0::2]))
    assert binomial_consistent(together_adjacent, n // 2, 0.25, 1e-9), together_adjacent
    assert binomial_consistent(together_successive, n // 2, 0.25, 1e-9), together_successive
    assert binomial_consistent(int(first.sum()), n, 0.5, 1e-9), int(first.sum())


@pytest.mark.exactness
def test_sharded_calls_reproduce_the_whole(device):
    """Each shard passing its global offset gets the bits of the unsharded call."""
    x = torch.randn(4, 1000).to(device)
    whole = fk.stochastic_round(x, seed=5)
    for row in range(4):
        assert_bitwise_equal(fk.stochastic_round(x[row], seed=5, offset=row * 1000), whole[row], f"shard {row}")


@pytest.mark.parametrize("bad, error", [
    (dict(seed=-1), "seed must be an integer"), (dict(seed=2**63), "seed must be an integer"),
    (dict(seed=1.5), "seed must be an integer"), (dict(seed=1, offset=-2), "offset must be"),
    (dict(seed=1, offset=2**32), "exceeds the 2\\*\\*32 counters"),
])
def test_bad_arguments_are_refused(bad, error, device):
    with pytest.raises(ValueError, match=error):
        fk.stochastic_round(torch.ones(3, device=device), **bad)
    with pytest.raises(TypeError, match="rounds float32"):
        fk.stochastic_round(torch.ones(3, dtype=torch.float64), seed=1)


@triton.jit
def _round_nearest_kernel(x_ptr, out_ptr, n, CAST: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    if CAST:
        rounded = rn_bf16_cast(x)
    else:
        rounded = rn_bf16(x)
    tl.store(out_ptr + i, rounded, mask=i < n)


@pytest.mark.exactness
@pytest.mark.parametrize("cast", [False, True], ids=["rn_bf16", "rn_bf16_cast"])
@given(bits=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300))
@example(bits=bf16_rounding_edges().tolist())
def test_nearest_rounding_matches_torch(cast, bits, device):
    """Both bf16 round-to-nearest-even forms equal torch's cast on the CPU, bit for bit
    (NaNs: a NaN): ``rn_bf16`` everywhere, and ``rn_bf16_cast``, which "nearest" stores use,
    the hardware's conversion compiled (``rn_bf16`` itself in the interpreter)."""
    x = fp32_from_bits(bits)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    _round_nearest_kernel[(triton.cdiv(x.numel(), 256),)](x.to(device), out, x.numel(), CAST=cast, BLOCK=256)
    expected = x.bfloat16()
    nan = torch.isnan(x)
    assert_bitwise_equal(out.cpu()[~nan], expected[~nan], "round to nearest")
    assert torch.isnan(out.cpu()[nan]).all()


@pytest.mark.exactness
@pytest.mark.interpreter
def test_interpreter_cast_to_bf16_truncates():
    """The defect rn_bf16 works around: the interpreter's fp32 -> bf16 cast truncates.
    If this starts failing, the interpreter was fixed; rn_bf16 stays correct either way."""
    @triton.jit
    def cast(x_ptr, out_ptr):
        i = tl.arange(0, 16)
        tl.store(out_ptr + i, tl.load(x_ptr + i).to(tl.bfloat16))

    x = torch.full((16,), 1.0 + 2**-8 + 2**-12)
    out = torch.empty(16, dtype=torch.bfloat16)
    cast[(1,)](x, out)
    assert torch.all(out == 1.0) and torch.all(x.bfloat16() == 1.0 + 2**-7)
