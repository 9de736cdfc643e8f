"""The zeroth-order claims fail on the mistakes they exist to catch: each mistake is
planted into the product code (monkeypatch) and the claim's own check is run on it.

* the enumeration (exact E[ĝ | U] and E[‖ĝ‖² | U]): a missing 1/B, δ divided by σ instead
  of 2σ, a Linear hook whose perturbation forgets the row signs (its forward no longer
  matches the update's Δ_i);
* the σ-independence bound: δ without the 1/(2σ) (the GRZO code's (ℓ⁺ - ℓ⁻)/2, unnormalised);
* the sign check: signs shared by every example (the GRZO code's parity checkerboard is
  planted in properties/test_zeroth_order_signs.py).
"""

import torch

import forge_kernels as fk
from forge_kernels.zeroth_order import grzo as grzo_module
from forge_kernels.zeroth_order import targets as targets_module
from forge_kernels.zeroth_order.draws import ROW, CallDraws, example_signs
from forge_verify.checks.zeroth_order import (enumeration_bounds, enumeration_errors, neighbour_products,
                                              quadratic_problem)
from forge_verify.numerics.stats import sign_products_consistent


def _case():
    problem = quadratic_problem(2, 2, 2, identical=False, seed=3)
    gen = torch.Generator().manual_seed(4)
    bases = {"weight": torch.randn(2, 2, generator=gen, dtype=torch.float64),
             "bias": torch.randn(2, generator=gen, dtype=torch.float64)}
    return problem, bases, fk.GRZO(problem.model, lr=0.1, sigma=1.0, normalize="none")


def _errors():
    return enumeration_errors(*_case())


def test_control_the_right_code_passes():
    """Within the derived rounding bounds (properties/test_zeroth_order_expectation.py),
    which are far below the 0.01 every planted mistake exceeds."""
    bounds = enumeration_bounds(*_case())
    assert all(error <= bound < 1e-6 for error, bound in zip(_errors(), bounds))


def test_a_missing_one_over_b_fails_the_enumeration(monkeypatch):
    original = grzo_module.GRZO._block_estimate
    monkeypatch.setattr(grzo_module.GRZO, "_block_estimate",
                        lambda self, target, draws, c, batch, rows: batch * original(self, target, draws, c, batch, rows))
    assert _errors()[0] > 0.01


def test_delta_over_sigma_instead_of_two_sigma_fails_the_enumeration(monkeypatch):
    original = grzo_module.coefficients
    monkeypatch.setattr(grzo_module, "coefficients",
                        lambda plus, minus, sigma, normalize, eps: 2 * original(plus, minus, sigma, normalize, eps))
    assert _errors()[0] > 0.01


def test_a_hook_without_row_signs_fails_the_enumeration(monkeypatch):
    """Multiplying the change by r_i again (r_i² = 1) drops the row signs from the forward."""
    original = targets_module.output_change

    def without_row_signs(target, draws, x, batch, block_elements, first=0):
        change = original(target, draws, x, batch, block_elements, first)
        if target.role == "linear":
            return change * targets_module._per_example(draws.signs(target, ROW, batch, first), change.dim())
        return change
    monkeypatch.setattr(targets_module, "output_change", without_row_signs)
    assert max(_errors()) > 0.01


def test_delta_without_sigma_fails_the_sigma_bound(monkeypatch):
    """(ℓ⁺ - ℓ⁻)/2 instead of /(2σ): ĝ scales with σ, far outside the rounding bound."""
    original = grzo_module.coefficients
    monkeypatch.setattr(grzo_module, "coefficients",
                        lambda plus, minus, sigma, normalize, eps: sigma * original(plus, minus, sigma, normalize, eps))
    problem = quadratic_problem(3, 4, 3, identical=False, seed=1)
    a = fk.GRZO(problem.model, lr=0.1, sigma=1e-2, normalize="none").estimate(problem.closure())["weight"]
    b = fk.GRZO(problem.model, lr=0.1, sigma=1.0, normalize="none").estimate(problem.closure())["weight"]
    assert float((a - b).abs().max()) > 0.5 * float(b.abs().max())


def test_signs_shared_by_every_example_fail_the_sign_check(monkeypatch):
    def shared(self, target, kind, batch, first=0):
        size = target.rows if kind == ROW else target.cols
        one = example_signs(self.key(target, kind), 1, size, target.work_dtype, target.param.device)
        return one.expand(batch, size)
    monkeypatch.setattr(CallDraws, "signs", shared)
    opt = fk.GRZO(torch.nn.Linear(16, 48), lr=0.1)
    signs = CallDraws(0, 0).signs(opt.targets[0], ROW, 64)
    mean, count = neighbour_products(signs)["examples"]
    assert not sign_products_consistent(mean, count)
