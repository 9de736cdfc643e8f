"""The statistical thresholds: each radius makes its tail bound equal the false-alarm rate."""

import math

import pytest

from forge_verify.numerics.stats import azuma_radius, freedman_radius, hoeffding_radius


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
