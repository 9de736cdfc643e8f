"""The statistical thresholds: each radius makes its tail bound equal the false-alarm rate;
the exact binomial test keeps its level and is tighter where it should be."""

import math

import pytest
from scipy.stats import binom

from forge_verify.numerics.stats import (azuma_radius, binomial_acceptance, binomial_consistent, freedman_radius,
                                        hoeffding_radius, sign_product_radius, sign_products_consistent)


def test_hoeffding_radius_meets_its_bound():
    t = hoeffding_radius(1000, 1e-6)
    assert 2 * math.exp(-2 * 1000 * t**2) == pytest.approx(1e-6)


def test_azuma_radius_meets_its_bound():
    t = azuma_radius(3.5, 1e-9)
    assert 2 * math.exp(-t**2 / (2 * 3.5)) == pytest.approx(1e-9)


@pytest.mark.parametrize("variance, increment", [(53.2, 0.19), (1.0, 0.0), (0.0, 2.0)])
def test_freedman_radius_meets_its_bound(variance, increment):
    t = freedman_radius(variance, increment, 1e-9)
    assert 2 * math.exp(-t**2 / (2 * (variance + increment * t / 3))) == pytest.approx(1e-9)


def test_freedman_is_tighter_than_azuma_when_variance_is_small():
    """Differences bounded by 1 whose conditional variances sum to 10 over 1000 steps."""
    assert freedman_radius(10.0, 1.0, 1e-9) < azuma_radius(1000 * 1.0**2, 1e-9) / 3


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        freedman_radius(-1.0, 1.0, 1e-9)
    with pytest.raises(ValueError):
        freedman_radius(1.0, 1.0, 1.5)


def test_binomial_test_accepts_the_expected_count_and_rejects_a_far_one():
    assert binomial_consistent(32768, 65536, 0.5, 1e-9)
    assert not binomial_consistent(32768 + 1500, 65536, 0.5, 1e-9)
    assert binomial_consistent(0, 100, 0.0, 1e-9) and not binomial_consistent(1, 100, 0.0, 1e-9)
    assert binomial_consistent(100, 100, 1.0, 1e-9) and not binomial_consistent(99, 100, 1.0, 1e-9)


def test_binomial_test_is_tighter_than_hoeffding_at_a_small_probability():
    """20 up-roundings in 2**16 where 1 is expected: Hoeffding's radius (about 0.014 at
    1e-9 / 64) lets it through, the exact test does not (p-value about 2e-19)."""
    trials, p, false_alarm = 2**16, 2**-16, 1e-9 / 64
    assert abs(20 / trials - p) <= hoeffding_radius(trials, false_alarm)
    assert not binomial_consistent(20, trials, p, false_alarm)
    assert binomial_consistent(3, trials, p, false_alarm)


def test_binomial_test_false_alarm_is_at_most_its_level():
    """Summed exactly over Binomial(200, 0.3): the outcomes the test rejects at 0.01 carry
    at most 0.01 of the probability (an exact test's p-value is super-uniform)."""
    trials, p, level = 200, 0.3, 0.01
    rejected = sum(binom.pmf(k, trials, p) for k in range(trials + 1)
                   if not binomial_consistent(k, trials, p, level))
    assert 0 < rejected <= level


@pytest.mark.parametrize("args", [(5, 0, 0.5, 0.1), (-1, 10, 0.5, 0.1), (11, 10, 0.5, 0.1), (5, 10, 1.5, 0.1),
                                  (5, 10, 0.5, 0.0)])
def test_binomial_test_refuses_bad_arguments(args):
    with pytest.raises(ValueError, match="0 <= successes <= trials"):
        binomial_consistent(*args)


@pytest.mark.parametrize("trials,p", [(65536, 0.5), (65536, 2**-16), (200, 0.3), (10, 0.999)])
def test_binomial_acceptance_is_the_interval_the_test_passes(trials, p):
    lo, hi = binomial_acceptance(trials, p, 1e-6)
    assert lo <= p * trials <= hi
    assert binomial_consistent(lo, trials, p, 1e-6) and binomial_consistent(hi, trials, p, 1e-6)
    assert lo == 0 or not binomial_consistent(lo - 1, trials, p, 1e-6)
    assert hi == trials or not binomial_consistent(hi + 1, trials, p, 1e-6)


@pytest.mark.parametrize("samples", [2, 199, 3072, 65536])
def test_sign_product_radius_is_the_edge_of_the_exact_test(samples):
    """|mean| at the radius passes, one more +1 fails, and the radius is the exact test's,
    below Hoeffding's at the same false-alarm rate."""
    radius = sign_product_radius(samples)
    plus = round((radius + 1) * samples / 2)
    assert sign_products_consistent(radius, samples) and sign_products_consistent(-radius, samples)
    assert plus == samples or not sign_products_consistent((2 * (plus + 1) - samples) / samples, samples)
    if samples >= 3072:
        assert radius < math.sqrt(2 * math.log(2 / 1e-6) / samples)


def test_sign_test_false_alarm_is_at_most_its_level():
    """Summed exactly over Binomial(300, ½): the means the sign test rejects at 0.01 carry
    at most 0.01 of the probability."""
    samples, level = 300, 0.01
    rejected = sum(binom.pmf(k, samples, 0.5) for k in range(samples + 1)
                   if not sign_products_consistent((2 * k - samples) / samples, samples, level))
    assert 0 < rejected <= level


def test_sign_test_rejects_a_checkerboard_and_a_small_bias():
    """All products -1 (a checkerboard's neighbours) and a 5 % excess of +1 over 65,536."""
    assert not sign_products_consistent(-1.0, 3072)
    assert not sign_products_consistent(0.1, 65536)
    assert sign_products_consistent(0.0, 65536)
