"""The float64 references are the rules users know: each equals torch.optim (or, for
Lion, the paper's update) in float64 over several steps. Fused == oracle and the
enclosure compare the kernel with our own formulas; this pins those formulas down.

Tolerance: both sides are float64 evaluations of the same real-number step, so each lies
within its running error bound of the exact step (proofs/reference_enclosure.md, "Two
float64 evaluations of one rule"): ours computed by ``RUNNING_ERROR`` along the reference,
torch.optim's (the same operations up to lerp and fused multiply-adds, its square root
within one ulp) by ``running_error(2)``. Their sum, about 4e-15 of max|w0| here, bounds
the difference."""

import pytest
import torch

import forge_kernels as fk
from forge_verify.checks.catalog import reference_step
from forge_verify.numerics.reference import POINT, RUNNING_ERROR, TORCH_OPTIM

CASES = [
    (fk.AdamW(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
     lambda p: torch.optim.AdamW([p], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, foreach=False)),
    (fk.Adam(lr=1e-2, betas=(0.8, 0.95), eps=1e-6),
     lambda p: torch.optim.Adam([p], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, foreach=False)),
    (fk.SGD(lr=0.1), lambda p: torch.optim.SGD([p], lr=0.1, foreach=False)),
    (fk.SGD(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
     lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01, foreach=False)),
    (fk.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
     lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=False)),
    (fk.RMSprop(lr=1e-2, alpha=0.9, eps=1e-6, weight_decay=0.01),
     lambda p: torch.optim.RMSprop([p], lr=1e-2, alpha=0.9, eps=1e-6, weight_decay=0.01, foreach=False)),
    (fk.RMSprop(lr=1e-2, alpha=0.9, eps=1e-6, momentum=0.5, centered=True),
     lambda p: torch.optim.RMSprop([p], lr=1e-2, alpha=0.9, eps=1e-6, momentum=0.5, centered=True, foreach=False)),
    (fk.Adagrad(lr=1e-1, lr_decay=0.05, weight_decay=0.01, initial_accumulator_value=0.1, eps=1e-8),
     lambda p: torch.optim.Adagrad([p], lr=1e-1, lr_decay=0.05, weight_decay=0.01, initial_accumulator_value=0.1,
                                   eps=1e-8, foreach=False)),
]


def _gradients(steps=4):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(5, 7, generator=gen, dtype=torch.float64), [
        torch.randn(5, 7, generator=gen, dtype=torch.float64) for _ in range(steps)]


def _bounded_trajectories(rule, w0, grads, arithmetics):
    """Per step, the reference's weight in each arithmetic (``Rounded`` values with bounds)."""
    runs = [(A.value(w0), {k: A.value(torch.full_like(w0, rule.initial_value(k))) for k in rule.slots})
            for A in arithmetics]
    for step, g in enumerate(grads, start=1):
        runs = [reference_step(rule, w, A.value(g), state, step, A) for A, (w, state) in zip(arithmetics, runs)]
        yield [w for w, _ in runs]


def _assert_within(ours, theirs, ours_bound, theirs_bound, what):
    """|ours - theirs| within the two running error bounds, element by element."""
    excess = (ours - theirs).abs() - (ours_bound + theirs_bound)
    assert float(excess.max()) <= 0, f"{what}: {int((excess > 0).sum())} element(s) outside the summed bounds"


def _check_against_torch_optim(rule, make_optimizer, perturb=lambda w: w):
    w0, grads = _gradients()
    param = torch.nn.Parameter(w0.clone())
    optimizer = make_optimizer(param)
    w, state = w0.clone(), {k: torch.full_like(w0, rule.initial_value(k)) for k in rule.slots}
    bounded = _bounded_trajectories(rule, w0, grads, (RUNNING_ERROR, TORCH_OPTIM))
    for step, (g, (ours, theirs)) in enumerate(zip(grads, bounded), start=1):
        param.grad = g.clone()
        optimizer.step()
        w, state = reference_step(rule, w, g, state, step, POINT)
        assert torch.equal(ours.value, w)  # the bound is the reference's own
        _assert_within(w, perturb(param.detach()), ours.error, theirs.error, f"step {step}")


@pytest.mark.parametrize("rule, make_optimizer", CASES, ids=[repr(c[0]) for c in CASES])
def test_reference_equals_torch_optim_in_float64(rule, make_optimizer):
    _check_against_torch_optim(rule, make_optimizer)


def test_the_bound_resolves_a_relative_change_of_1e_13():
    """Not vacuous: torch.optim's weight moved by one part in 10^13 (which the former fixed
    tolerance, 1e-12 of max|w0|, let through) is outside the summed bounds."""
    rule, make_optimizer = CASES[0]
    with pytest.raises(AssertionError, match="outside the summed bounds"):
        _check_against_torch_optim(rule, make_optimizer, perturb=lambda w: w * (1 + 1e-13))


def _lion_paper_step(A, w, m, g, lr, b1, b2, wd):
    """Chen et al. 2023, Algorithm 2: c = b1 m + (1-b1) g; w -= lr (sign(c) + wd w); m = b2 m + (1-b2) g."""
    c = A.const(b1) * m + A.const(1 - b1) * g
    w = w - A.const(lr) * (A.sign(c) + A.const(wd) * w)
    return w, A.const(b2) * m + A.const(1 - b2) * g


def test_lion_reference_equals_the_paper():
    """The weight within both evaluations' running error bounds (each correctly rounded
    float64); the moment, the same operations in the same order, bitwise."""
    lr, b1, b2, wd = 1e-2, 0.9, 0.99, 0.1
    w0, grads = _gradients()
    rule = fk.Lion(lr=lr, betas=(b1, b2), weight_decay=wd)
    w, state = w0.clone(), {"exp_avg": torch.zeros_like(w0)}
    paper = (RUNNING_ERROR.value(w0), RUNNING_ERROR.value(torch.zeros_like(w0)))
    bounded = _bounded_trajectories(rule, w0, grads, (RUNNING_ERROR,))
    for step, (g, (ours,)) in enumerate(zip(grads, bounded), start=1):
        paper = _lion_paper_step(RUNNING_ERROR, *paper, RUNNING_ERROR.value(g), lr, b1, b2, wd)
        w, state = reference_step(rule, w, g, state, step, POINT)
        assert torch.equal(ours.value, w)
        _assert_within(w, paper[0].value, ours.error, paper[0].error, f"step {step}")
        assert torch.equal(state["exp_avg"], paper[1].value)
