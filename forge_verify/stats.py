"""Thresholds for statistical tests, derived in advance (proofs/stochastic_rounding.md)."""

import math


def hoeffding_radius(samples: int, false_alarm: float) -> float:
    """t with P(|mean - p| >= t) <= false_alarm for the mean of ``samples`` independent
    variables in [0, 1] (Hoeffding: 2 exp(-2 n t^2))."""
    if samples <= 0 or not 0 < false_alarm < 1:
        raise ValueError("need samples > 0 and 0 < false_alarm < 1")
    return math.sqrt(math.log(2 / false_alarm) / (2 * samples))


def azuma_radius(bounds_squared_sum: float, false_alarm: float) -> float:
    """t with P(|S_n - E S_n| >= t) <= false_alarm for a martingale whose differences
    satisfy |d_i| <= c_i, given sum c_i^2 (Azuma: 2 exp(-t^2 / (2 sum c_i^2)))."""
    return math.sqrt(2 * bounds_squared_sum * math.log(2 / false_alarm))
