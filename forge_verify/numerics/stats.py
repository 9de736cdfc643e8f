"""Thresholds for statistical tests, derived in advance (proofs/stochastic_rounding.md),
and the exact tests used where the statistic's distribution is known exactly."""

import math

from scipy.stats import binom, binomtest


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


# The fp32 additions' own rounding in the stagnation experiment, up to 1,000 additions
# of 1e-3 to values below 4: 1000 · 2**-23 plus 1e-3's rounding to fp32, 1000 times,
# under 2e-4 (proofs/stochastic_rounding.md, "Stagnation").
STAGNATION_ADDITION_SLACK = 2e-4


def stagnation_radius(additions: int, chains: int, false_alarm: float) -> float:
    """Threshold for |mean - exact| after ``additions`` (at most 1,000) additions of 1e-3,
    each stored to bf16 by stochastic rounding, averaged over ``chains`` chains below 4:
    each addition moves a chain by less than one bf16 ulp there (2**-6) from its
    expectation, so the mean is a martingale with differences at most 2**-6 / chains
    (Azuma), plus the fp32 additions' rounding."""
    if not 0 <= additions <= 1000:
        raise ValueError("the addition slack is derived for at most 1,000 additions")
    return azuma_radius(additions * chains * (2.0**-6 / chains) ** 2, false_alarm) + STAGNATION_ADDITION_SLACK


def chebyshev_radius(variance: float, samples: int, false_alarm: float) -> float:
    """t with P(‖mean - E‖ >= t) <= false_alarm for the mean of ``samples`` independent
    vectors whose covariance has trace at most ``variance`` (Chebyshev–Markov on the
    squared norm: E‖mean - E‖² = variance / samples); also the scalar case."""
    if variance < 0 or samples <= 0 or not 0 < false_alarm < 1:
        raise ValueError("need variance >= 0, samples > 0 and 0 < false_alarm < 1")
    return math.sqrt(variance / (samples * false_alarm))


def dkw_radius(samples: int, false_alarm: float) -> float:
    """t with P(sup_x |F_n(x) - F(x)| > t) <= false_alarm for the empirical distribution
    function of ``samples`` independent draws from a continuous F (Dvoretzky–Kiefer–
    Wolfowitz with Massart's constant: 2 exp(-2 n t^2))."""
    if samples <= 0 or not 0 < false_alarm < 1:
        raise ValueError("need samples > 0 and 0 < false_alarm < 1")
    return math.sqrt(math.log(2 / false_alarm) / (2 * samples))


def binomial_consistent(successes: int, trials: int, p: float, false_alarm: float) -> bool:
    """Whether ``successes`` out of ``trials`` is consistent with Binomial(``trials``, ``p``)
    at ``false_alarm``: the exact two-sided binomial test (``scipy.stats.binomtest``,
    probabilities of outcomes no likelier than the one seen) has p-value at least
    ``false_alarm``. Exact tests' p-values are super-uniform, so a correct sampler fails
    with probability at most ``false_alarm``; at small ``p`` the exact test is far
    tighter than Hoeffding's radius (proofs/stochastic_rounding.md). ``p`` of 0 or 1
    admits only the certain count."""
    if trials <= 0 or not 0 <= successes <= trials or not 0 <= p <= 1 or not 0 < false_alarm < 1:
        raise ValueError("need 0 <= successes <= trials, trials > 0, 0 <= p <= 1 and 0 < false_alarm < 1")
    if p in (0.0, 1.0):
        return successes == round(p * trials)
    return binomtest(successes, trials, p).pvalue >= false_alarm


def binomial_acceptance(trials: int, p: float, false_alarm: float) -> tuple[int, int]:
    """The counts (lo, hi) that ``binomial_consistent`` passes: an interval, since the
    rejected outcomes are the least likely ones and the binomial is unimodal; each end
    found by bisection from the mode. For plotting the exact test's band."""
    mode = min(trials, math.floor((trials + 1) * p))
    if not binomial_consistent(mode, trials, p, false_alarm):
        raise ValueError(f"no count passes at false_alarm={false_alarm}")

    def edge(inside: int, outside: int) -> int:  # inside passes, outside fails (or is past the range)
        while abs(outside - inside) > 1:
            middle = (inside + outside) // 2
            if binomial_consistent(middle, trials, p, false_alarm):
                inside = middle
            else:
                outside = middle
        return inside

    return edge(mode, -1), edge(mode, trials + 1)


# The false-alarm rate of each sign-independence check (proofs/zeroth_order.md, "Signs").
SIGN_FALSE_ALARM = 1e-6


def _plus_count(mean: float, samples: int) -> int:
    """The number of +1 among ``samples`` ±1 values whose mean is ``mean`` (an integer
    count, recovered from the floating-point mean)."""
    return round((mean + 1) * samples / 2)


def sign_products_consistent(mean: float, samples: int, false_alarm: float = SIGN_FALSE_ALARM) -> bool:
    """Whether the mean of ``samples`` ±1 sign products is consistent with independent fair
    signs. Under that claim the products are themselves independent fair signs (neighbour
    products included: proofs/zeroth_order.md), so their count of +1 is exactly
    Binomial(``samples``, ½) and the exact binomial test decides, at ``false_alarm``."""
    return binomial_consistent(_plus_count(mean, samples), samples, 0.5, false_alarm)


def sign_product_radius(samples: int, false_alarm: float = SIGN_FALSE_ALARM) -> float:
    """The largest |mean| that ``sign_products_consistent`` passes (its acceptance is
    symmetric about 0): about 4.9/√n at 1e-6, where Hoeffding's radius at the same rate is
    sqrt(2 ln(2/α)/n) = 5.4/√n. For reports, which plot |mean| against it."""
    _, hi = binomial_acceptance(samples, 0.5, false_alarm)
    return (2 * hi - samples) / samples


#: the median-of-means radius in standard errors of one group's mean: each group mean
#: is that far off with probability at most 1/MOM_SPREAD² (Chebyshev)
MOM_SPREAD = 2.5


def median_of_means_groups(false_alarm: float) -> int:
    """The fewest groups k (odd) whose median of means is more than MOM_SPREAD standard
    errors of a group's mean off with probability at most ``false_alarm``: that needs
    (k + 1)/2 groups off, each independently with probability at most p = 1/MOM_SPREAD²,
    so the chance is at most P(Binomial(k, p) ≥ (k + 1)/2) (exact, scipy;
    proofs/zeroth_order.md, "Monte Carlo radii"). 15 at 1e-3."""
    groups = 1
    while binom.sf(groups // 2, groups, 1 / MOM_SPREAD**2) > false_alarm:
        groups += 2
    return groups


def median_of_means(values, groups: int) -> float:
    """The median of the means of ``groups`` consecutive equal groups of ``values`` (a 1-D
    torch tensor; the last len(values) mod groups values are left out)."""
    size = len(values) // groups
    return float(values[:size * groups].reshape(groups, size).mean(1).median())


def median_of_means_radius(variance: float, samples: int, groups: int) -> float:
    """MOM_SPREAD standard errors of one group's mean, for values of variance at most
    ``variance``: the median of means is within it of their mean but with probability at
    most the false alarm ``median_of_means_groups`` was given."""
    return chebyshev_radius(variance, samples // groups, 1 / MOM_SPREAD**2)
