"""The float64 references are the rules users know: each equals torch.optim (or, for
Lion, the paper's update) in float64 over several steps. Fused == oracle and the
enclosure compare the kernel with our own formulas; this pins those formulas down.

Tolerance: both sides are float64 evaluations of the same real-number step in
different operation orders; a handful of float64 roundings per step, relative to the
step's operands, stays far below 1e-12 of max|w| (measured: about 5e-16)."""

import pytest
import torch

import forge_kernels as fk
from forge_verify.checks.catalog import reference_step
from forge_verify.numerics.reference import POINT

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


@pytest.mark.parametrize("rule, make_optimizer", CASES, ids=[repr(c[0]) for c in CASES])
def test_reference_equals_torch_optim_in_float64(rule, make_optimizer):
    w0, grads = _gradients()
    param = torch.nn.Parameter(w0.clone())
    optimizer = make_optimizer(param)
    w, state = w0.clone(), {k: torch.full_like(w0, rule.initial_value(k)) for k in rule.slots}
    for step, g in enumerate(grads, start=1):
        param.grad = g.clone()
        optimizer.step()
        w, state = reference_step(rule, w, g, state, step, POINT)
        torch.testing.assert_close(w, param.detach(), rtol=0, atol=1e-12 * float(w0.abs().max()))


def test_lion_reference_equals_the_paper():
    """Chen et al. 2023, Algorithm 2: c = b1 m + (1-b1) g; w -= lr (sign(c) + wd w); m = b2 m + (1-b2) g."""
    lr, b1, b2, wd = 1e-2, 0.9, 0.99, 0.1
    w0, grads = _gradients()
    w_paper, m = w0.clone(), torch.zeros_like(w0)
    w, state = w0.clone(), {"exp_avg": torch.zeros_like(w0)}
    rule = fk.Lion(lr=lr, betas=(b1, b2), weight_decay=wd)
    for step, g in enumerate(grads, start=1):
        c = b1 * m + (1 - b1) * g
        w_paper = w_paper - lr * (torch.sign(c) + wd * w_paper)
        m = b2 * m + (1 - b2) * g
        w, state = reference_step(rule, w, g, state, step, POINT)
        torch.testing.assert_close(w, w_paper, rtol=0, atol=1e-12)
        torch.testing.assert_close(state["exp_avg"], m, rtol=0, atol=1e-15)
