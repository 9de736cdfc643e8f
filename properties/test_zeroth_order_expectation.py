"""GRZO's estimate in expectation, exactly (no statistics): for a fixed base U, the mean
of ĝ over every joint sign pattern of every example, each run through the optimizer's
own hooks and update formula, is U ⊙ U ⊙ ḡ, and its mean square is the closed form of
proofs/zeroth_order.md ("Second moment given U"). Averaged over U ~ N(0, I) by
Gauss–Hermite quadrature (exact for these degree-4 polynomials) the closed form gives
the variance law; MeZO's law is the same quadrature of its ‖ĝ‖² over z. On quadratic
losses the estimate does not depend on σ.

Tolerances are float64 rounding only (the enumerated means and the quadratures are exact
in real arithmetic), each a bound derived with gamma() from the operations the compared
numbers take, evaluated at the problem's magnitudes (proofs/zeroth_order.md, "Rounding
in the exact tests"; ``enumeration_bounds``, ``grzo_law_rounding_bound``,
``mezo_law_rounding_bound``).
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import forge_kernels as fk
from forge_kernels.zeroth_order.draws import CallDraws
from forge_verify.checks.observations import RADIUS, observe
from forge_verify.checks.zeroth_order import (enumeration_bounds, enumeration_errors, flatten, gaussian_expectation,
                                              grzo_conditional_second_moment, grzo_law_rounding_bound,
                                              grzo_trace_variance, mezo_law_rounding_bound, mezo_squared_norm,
                                              mezo_trace_variance, quadratic_problem)
from forge_verify.numerics.tolerances import gamma

#: (d_out, d_in, batch, bias): joint patterns 2**(batch · (d_out + d_in + d_out·bias)) ≤ 4,096
SHAPES = [(2, 2, 1, True), (2, 2, 2, True), (1, 3, 2, True), (2, 3, 1, False), (1, 2, 3, True), (3, 1, 2, False)]


@pytest.mark.exactness
@given(shape=st.sampled_from(SHAPES), identical=st.booleans(), seed=st.integers(0, 2**16),
       scale=st.floats(0.25, 4.0))
def test_mean_over_every_sign_pattern_is_u_u_g(shape, identical, seed, scale):
    d_out, d_in, batch, bias = shape
    problem = quadratic_problem(d_out, d_in, batch, identical=identical, bias=bias, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    bases = {"weight": scale * torch.randn(d_out, d_in, generator=gen, dtype=torch.float64)}
    if bias:
        bases["bias"] = scale * torch.randn(d_out, generator=gen, dtype=torch.float64)
    opt = fk.GRZO(problem.model, lr=0.1, sigma=1.0, normalize="none")
    mean_error, second_error = enumeration_errors(problem, bases, opt)
    mean_bound, second_bound = enumeration_bounds(problem, bases, opt)
    assert mean_error <= mean_bound and second_error <= second_bound
    observe(max(mean_error / mean_bound, second_error / second_bound), RADIUS)


@pytest.mark.exactness
@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("identical", [True, False], ids=["identical", "heterogeneous"])
def test_variance_law_is_the_gaussian_mean_of_the_second_moment(batch, identical):
    """E_U E[‖ĝ‖² | U] - ‖ḡ‖² = ((d - 1)/B) mean‖g_i‖² + 2‖ḡ‖², d = 6 (a 2 × 2 weight and
    its bias), by 3-node Gauss–Hermite quadrature over the 6 coordinates of U."""
    problem = quadratic_problem(2, 2, batch, identical=identical, seed=batch)
    grads = problem.per_example_gradients()
    second = gaussian_expectation(lambda u: grzo_conditional_second_moment(u, grads), grads.shape[1])
    law = grzo_trace_variance(grads)
    got = second - float((grads.mean(0) ** 2).sum())
    bound = grzo_law_rounding_bound(grads)
    assert abs(got - law) <= bound
    assert 2 * bound < float((grads.mean(0) ** 2).sum())  # so a law off by ‖ḡ‖² fails the line above
    observe(abs(got - law) / bound, RADIUS)


@pytest.mark.exactness
@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("identical", [True, False], ids=["identical", "heterogeneous"])
def test_mezo_variance_law_is_the_gaussian_mean_of_its_squared_norm(batch, identical):
    """E_z ‖ĝ‖² - ‖ḡ‖² = (d + 1)‖ḡ‖², d = 6, by 3-node Gauss–Hermite quadrature over z:
    ‖ĝ‖² = ⟨ḡ, z⟩² ‖z‖² (MeZO's ĝ = ⟨ḡ, z⟩ z, tests/test_zeroth_order.py) has degree 4
    in each coordinate, so the quadrature is exact. A wrong law ((d + 2)‖ḡ‖², d‖ḡ‖²) is
    off by ‖ḡ‖², some 1/7 of it, far outside the float64 rounding allowed."""
    problem = quadratic_problem(2, 2, batch, identical=identical, seed=batch)
    mean_grad = problem.per_example_gradients().mean(0)
    second = gaussian_expectation(lambda z: mezo_squared_norm(z, mean_grad), mean_grad.numel())
    law = mezo_trace_variance(mean_grad)
    got = second - float((mean_grad ** 2).sum())
    bound = mezo_law_rounding_bound(mean_grad)
    assert abs(got - law) <= bound
    assert 2 * bound < float((mean_grad ** 2).sum())  # so a law off by ‖ḡ‖² fails the line above
    observe(abs(got - law) / bound, RADIUS)


@pytest.mark.exactness
@given(sigma=st.floats(1e-4, 1.0), seed=st.integers(0, 2**16), batch=st.integers(1, 6))
def test_estimate_does_not_depend_on_sigma_on_quadratic_losses(sigma, seed, batch):
    """Central differences of a quadratic are exact: ĝ at σ equals ĝ at σ = 1 up to the
    rounding of the losses, at most 4 γ_64 max|ℓ| / (2σ) per δ_i (both σ), times
    max|Δ_i| = max|U|. A δ_i that keeps a power of σ (the GRZO code's (ℓ⁺ - ℓ⁻)/2, used
    unnormalised) is off by that power; a constant factor is the enumeration's to catch."""
    problem = quadratic_problem(3, 4, batch, identical=False, seed=seed)
    names = ["weight", "bias"]
    estimates, largest = [], []
    for s in (sigma, 1.0):
        opt = fk.GRZO(problem.model, lr=0.1, sigma=s, normalize="none", seed=seed)
        seen = []
        def closure():
            seen.append(problem.losses())
            return seen[-1]
        estimates.append(flatten(opt.estimate(closure), names))
        largest.append(max(float(v.abs().max()) for v in seen))
    draws, targets = CallDraws(seed, 0), fk.GRZO(problem.model, lr=0.1, seed=seed).targets
    base_max = max(float(draws.base(t, torch.arange(t.rows) if t.is_matrix else None).abs().max()) for t in targets)
    bound = sum(4 * gamma(64, 2.0**-53) * big / (2 * s) for big, s in zip(largest, (sigma, 1.0))) * base_max
    error = float((estimates[0] - estimates[1]).abs().max())
    assert error <= bound
    observe(error / bound, RADIUS)
