"""GRZO and MeZO over many calls of the real draws (Philox streams of the optimizer's own
seed and counter, computed for 1.6·10⁵ or 2·10⁵ calls at once): the mean estimate is within
a Chebyshev radius of ḡ, the trace of the covariance follows the variance law within a
median-of-means radius, and the std-normalised estimator points where the raw one does,
call by call, with its mean's small-B bias measured.

Thresholds, fixed in advance (proofs/zeroth_order.md, "Monte Carlo radii"), each for a
false-alarm probability FALSE_ALARM per check, with seeds fixed:

* mean: ‖mean - ḡ‖ ≤ sqrt(V / (n α)), V the law's trace variance;
* trace variance: the median of the means of k = 15 groups of ‖ĝ‖², less ‖ḡ‖², is
  within 2.5 sqrt(S / (n/k)) of V, S a bound on Var ‖ĝ‖²: (2d² + 26d + 68)‖ḡ‖⁴ exactly
  (MeZO), K_d mean‖g_i‖⁴ with K_d = 3d² + 30d + 72 (GRZO, a bound on E‖ĝ‖⁴).

What the trace-variance check can tell apart (d = 6): the radius is 0.37‖ḡ‖² for MeZO
(n = 2·10⁵; 5 % of V = 7‖ḡ‖²) on every problem, and 0.46‖ḡ‖² for GRZO with identical
examples (n = 1.6·10⁵; 7 %, 14 % and 20 % of V at B = 1, 4, 16), so there a law off by
‖ḡ‖² or more fails it: MeZO's (d + 2)‖ḡ‖² or d‖ḡ‖² for (d + 1)‖ḡ‖², GRZO's 3‖ḡ‖² for
2‖ḡ‖² (checked below; under Chebyshev's radius both passed). For GRZO's heterogeneous
examples at B = 4 and 16 it is 2.2 and 1.8 ‖ḡ‖² (35 % and 62 % of V: mean‖g_i‖⁴ ≫ ‖ḡ‖⁴
there), which cannot tell such a change; the exact quadrature test
(test_zeroth_order_expectation.py) carries both laws on every problem. The check
separates GRZO from MeZO for identical examples at B = 16 (test below). The module stays
near a minute on two shared cores (the B = 16 draws dominate).
"""

import functools

import pytest
import torch

import forge_kernels as fk
from forge_verify.checks.observations import RADIUS, observe
from forge_verify.checks.zeroth_order import (flatten, fourth_moment_factor, grzo_estimates_over_calls,
                                              grzo_projections_over_calls, grzo_trace_variance,
                                              mezo_estimates_over_calls, mezo_squared_norm_variance,
                                              mezo_trace_variance, quadratic_problem)
from forge_verify.numerics.stats import (chebyshev_radius, median_of_means, median_of_means_groups,
                                        median_of_means_radius)

FALSE_ALARM = 1e-3
CALLS = {"GRZO": 160_000, "MeZO": 200_000}
GROUPS = median_of_means_groups(FALSE_ALARM)
BATCHES = [1, 4, 16]
KINDS = ["identical", "heterogeneous"]


@functools.lru_cache(maxsize=None)
def _samples(method, batch, kind):
    problem = quadratic_problem(2, 2, batch, identical=kind == "identical", seed=batch)
    estimates = (grzo_estimates_over_calls if method == "GRZO" else mezo_estimates_over_calls)(
        problem, 11, range(CALLS[method]))
    return problem, problem.per_example_gradients(), estimates


def _law(method, grads):
    return grzo_trace_variance(grads) if method == "GRZO" else mezo_trace_variance(grads.mean(0))


def _trace_variance(method, grads, estimates):
    """(the median-of-means estimate of the trace variance, its radius)."""
    d = grads.shape[1]
    if method == "GRZO":
        spread = fourth_moment_factor(d) * float((grads.norm(dim=1) ** 4).mean())
    else:
        spread = mezo_squared_norm_variance(grads.mean(0))
    measured = median_of_means((estimates ** 2).sum(1), GROUPS) - float((grads.mean(0) ** 2).sum())
    return measured, median_of_means_radius(spread, len(estimates), GROUPS)


@pytest.mark.exactness
@pytest.mark.parametrize("method", ["GRZO", "MeZO"])
def test_the_many_calls_reference_is_the_optimizer(method):
    """The first calls of fk.GRZO / fk.MeZO (two forwards each) agree with the reference
    the statistics use to float64 rounding (1e-12 relative; σ = ε = 1)."""
    problem = quadratic_problem(2, 2, 4, identical=False, seed=3)
    if method == "GRZO":
        opt = fk.GRZO(problem.model, lr=0.1, sigma=1.0, normalize="none", seed=11)
        got = torch.stack([flatten(opt.estimate(problem.closure()), ["weight", "bias"]) for _ in range(4)])
        want = grzo_estimates_over_calls(problem, 11, range(4))
    else:
        opt = fk.MeZO(problem.model, lr=0.1, eps=1.0, seed=11)
        got = torch.stack([flatten(opt.estimate(lambda: problem.losses().mean()), ["weight", "bias"])
                           for _ in range(4)])
        want = mezo_estimates_over_calls(problem, 11, range(4))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))


@pytest.mark.stats
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("method", ["GRZO", "MeZO"])
def test_mean_estimate_is_within_the_chebyshev_radius_of_the_gradient(method, batch, kind):
    _, grads, estimates = _samples(method, batch, kind)
    radius = chebyshev_radius(_law(method, grads), CALLS[method], FALSE_ALARM)
    error = float((estimates.mean(0) - grads.mean(0)).norm())
    assert error <= radius
    observe(error / radius, RADIUS)


@pytest.mark.stats
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("method", ["GRZO", "MeZO"])
def test_trace_variance_follows_the_law(method, batch, kind):
    """Where the radius is below ‖ḡ‖²/2 (MeZO; GRZO on identical examples, asserted), a
    law off by ‖ḡ‖² (MeZO's (d + 2)‖ḡ‖², GRZO's 3‖ḡ‖² for 2‖ḡ‖²) lies outside it."""
    _, grads, estimates = _samples(method, batch, kind)
    measured, radius = _trace_variance(method, grads, estimates)
    error = abs(measured - _law(method, grads))
    assert error <= radius
    observe(error / radius, RADIUS)
    if method == "MeZO" or kind == "identical" or batch == 1:
        assert radius < 0.5 * float((grads.mean(0) ** 2).sum())


@pytest.mark.stats
def test_grzo_beats_mezo_for_agreeing_examples_and_not_for_opposing_ones():
    """Identical examples, B = 16: GRZO's measured trace variance plus its radius is below
    MeZO's minus its radius (law: 2.31 vs 7 ‖g‖²). Two opposing examples (ḡ = 0): MeZO's
    estimate is 0 every call, GRZO's is not: its variance is ((d - 1)/2) ‖g‖²."""
    def measured(method):
        _, grads, estimates = _samples(method, 16, "identical")
        return _trace_variance(method, grads, estimates)
    (grzo, r_grzo), (mezo, r_mezo) = measured("GRZO"), measured("MeZO")
    assert grzo + r_grzo < mezo - r_mezo

    problem = quadratic_problem(2, 2, 2, identical=False, seed=5)
    with torch.no_grad():
        problem.inputs[1] = problem.inputs[0]
        problem.targets[1] = 2 * problem.model(problem.inputs[:1])[0] - problem.targets[0]
    grads = problem.per_example_gradients()
    assert float(grads.mean(0).abs().max()) < 1e-12
    assert float(mezo_estimates_over_calls(problem, 11, range(100)).abs().max()) < 1e-12
    assert float(grzo_estimates_over_calls(problem, 11, range(100)).abs().max()) > 0.1
    assert mezo_trace_variance(grads.mean(0)) < 1e-20 < grzo_trace_variance(grads)


@pytest.mark.stats
@pytest.mark.parametrize("batch", [2, 4, 16])
def test_std_normalisation_keeps_each_direction_and_its_mean_bias_is_measured(batch):
    """normalize="std" is the raw estimate divided by std(δ) + eps: the same direction on
    every call (checked through fk.GRZO on 64 calls, cosine 1 to 1e-12). Its mean over
    calls is not a multiple of ḡ; the angle to ḡ is measured (observed, in degrees, not
    bounded: no bound is derived for it), against the raw mean's."""
    problem = quadratic_problem(2, 2, batch, identical=False, seed=batch)
    raw = fk.GRZO(problem.model, lr=0.1, sigma=1.0, normalize="none", seed=11)
    normalised = fk.GRZO(problem.model, lr=0.1, sigma=1.0, normalize="std", seed=11)
    names = ["weight", "bias"]
    for _ in range(64):
        a = flatten(raw.estimate(problem.closure()), names)
        b = flatten(normalised.estimate(problem.closure()), names)
        cosine = float(a @ b / (a.norm() * b.norm()))
        assert abs(cosine - 1) <= 1e-12

    grads = problem.per_example_gradients()
    delta, projections = grzo_projections_over_calls(problem, 11, range(50_000))
    estimates = (projections[:, :, None] * delta).mean(1)
    scaled = estimates / (projections.std(dim=1, correction=1)[:, None] + 1e-8)
    mean_grad = grads.mean(0)
    def angle(v):
        return float(torch.rad2deg(torch.arccos((v @ mean_grad / (v.norm() * mean_grad.norm())).clamp(-1, 1))))
    observe(angle(scaled.mean(0)), "degrees from ḡ (std-normalised mean)")
    observe(angle(estimates.mean(0)), "degrees from ḡ (raw mean)")
    assert float(scaled.mean(0) @ mean_grad) > 0
