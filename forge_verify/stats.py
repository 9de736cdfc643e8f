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


def freedman_radius(variance_bound: float, increment_bound: float, false_alarm: float) -> float:
    """t with P(|S_n - E S_n| >= t) <= false_alarm for a martingale whose differences
    satisfy |d_i| <= b and whose conditional variances sum to at most V (Freedman:
    2 exp(-t^2 / (2 (V + b t / 3)))): the positive root of t^2 = 2 L (V + b t / 3),
    L = ln(2 / false_alarm). Tighter than Azuma when the differences are rarely large."""
    if variance_bound < 0 or increment_bound < 0 or not 0 < false_alarm < 1:
        raise ValueError("need V >= 0, b >= 0 and 0 < false_alarm < 1")
    log_term = math.log(2 / false_alarm)
    linear = 2 * log_term * increment_bound / 3
    return (linear + math.sqrt(linear**2 + 8 * log_term * variance_bound)) / 2
