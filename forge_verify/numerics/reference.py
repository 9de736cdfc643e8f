"""References of the optimizer rules and of the weight gradient.

Each rule's reference is written once, as the textbook formula in the same
operation order as the kernel, over an *arithmetic*:

* ``POINT``: float64 tensors, the slow obviously-correct reference;
* ``ENCLOSURE``: :class:`~forge_verify.numerics.interval.Interval`, a rigorous bound on
  every value an fp32 kernel evaluating that sequence can produce.

The hyperparameter-derived scalars (bias corrections, first-step momentum, the
Adagrad learning-rate decay) are recomputed here from the rule's hyperparameters,
independently of ``Rule.scalars``, so a mistake there shows up as a deviation.
"""

import math

import torch

from .interval import Interval, sqrt_rn
from .tolerances import FP32_UNDERFLOW, UNIT_ROUNDOFF, accumulation_rtol, gamma


class _Point:
    name = "fp64"

    @staticmethod
    def const(c):
        return float(c)

    @staticmethod
    def value(t):
        return t.detach().to(torch.float64)

    @staticmethod
    def sqrt(x):
        return sqrt_rn(x)

    @staticmethod
    def sign(x):
        return torch.sign(x)

    @staticmethod
    def clamp_nonnegative(x):
        return x.clamp_min(0)


class _Enclosure:
    name = "enclosure"

    @staticmethod
    def const(c):
        return Interval.host_scalar(c)

    @staticmethod
    def value(t):
        return Interval.exact(t.detach().cpu())

    @staticmethod
    def sqrt(x):
        return x.sqrt()

    @staticmethod
    def sign(x):
        return x.sign()

    @staticmethod
    def clamp_nonnegative(x):
        # max(., 0) is exact and monotone: clamp both ends.
        return Interval(x.lo.clamp_min(0), x.hi.clamp_min(0))


POINT = _Point()
ENCLOSURE = _Enclosure()


def adamw(A, w, g, s, rule, step):
    beta1, beta2 = rule.betas
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    w = w * A.const(1.0 - rule.lr * rule.weight_decay)
    m = A.const(beta1) * s["exp_avg"] + A.const(1.0 - beta1) * g
    v = A.const(beta2) * s["exp_avg_sq"] + A.const(1.0 - beta2) * (g * g)
    denom = A.sqrt(v) / A.const(math.sqrt(bias_correction2)) + A.const(rule.eps)
    w = w - A.const(rule.lr / bias_correction1) * (m / denom)
    return w, {"exp_avg": m, "exp_avg_sq": v}


def sgd(A, w, g, s, rule, step):
    d = g + A.const(rule.weight_decay) * w if rule.weight_decay != 0 else g
    state = {}
    if rule.momentum != 0:
        # torch.optim: the buffer starts as a copy of the first (decayed) gradient.
        buf = d if step == 1 else A.const(rule.momentum) * s["momentum_buffer"] + A.const(1.0 - rule.dampening) * d
        d = d + A.const(rule.momentum) * buf if rule.nesterov else buf
        state["momentum_buffer"] = buf
    return w - A.const(rule.lr) * d, state


def lion(A, w, g, s, rule, step):
    beta1, beta2 = rule.betas
    direction = A.sign(A.const(beta1) * s["exp_avg"] + A.const(1.0 - beta1) * g)
    w = w * A.const(1.0 - rule.lr * rule.weight_decay) - A.const(rule.lr) * direction
    m = A.const(beta2) * s["exp_avg"] + A.const(1.0 - beta2) * g
    return w, {"exp_avg": m}


def rmsprop(A, w, g, s, rule, step):
    d = g + A.const(rule.weight_decay) * w if rule.weight_decay != 0 else g
    alpha = rule.alpha
    square_avg = A.const(alpha) * s["square_avg"] + A.const(1.0 - alpha) * (d * d)
    state = {"square_avg": square_avg}
    if rule.centered:
        grad_avg = A.const(alpha) * s["grad_avg"] + A.const(1.0 - alpha) * d
        avg = A.sqrt(A.clamp_nonnegative(square_avg - grad_avg * grad_avg)) + A.const(rule.eps)
        state["grad_avg"] = grad_avg
    else:
        avg = A.sqrt(square_avg) + A.const(rule.eps)
    if rule.momentum != 0:
        buf = A.const(rule.momentum) * s["momentum_buffer"] + d / avg
        state["momentum_buffer"] = buf
        return w - A.const(rule.lr) * buf, state
    return w - A.const(rule.lr) * (d / avg), state


def adagrad(A, w, g, s, rule, step):
    d = g + A.const(rule.weight_decay) * w if rule.weight_decay != 0 else g
    clr = rule.lr / (1.0 + (step - 1) * rule.lr_decay)
    state_sum = s["sum"] + d * d
    std = A.sqrt(state_sum) + A.const(rule.eps)
    return w - A.const(clr) * (d / std), {"sum": state_sum}


def weight_grad(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dW = dyᵀ x in float64 (the products of fp32 or bf16 inputs are exact in float64)."""
    return dy.detach().cpu().to(torch.float64).T @ x.detach().cpu().to(torch.float64)


def weight_grad_enclosure(x: torch.Tensor, dy: torch.Tensor, backend: str) -> Interval:
    """An interval containing every fp32 dW the kernel can compute on ``backend``.

    |fp32 sum - exact| <= accumulation_rtol * S and |float64 sum - exact| <= gamma_T(u64) * S,
    with S = sum_t |dy_ti x_tj| (itself computed in float64, so inflated by gamma_T(u64)).
    """
    T = x.shape[0]
    xd, dyd = x.detach().cpu().to(torch.float64), dy.detach().cpu().to(torch.float64)
    center = dyd.T @ xd
    abs_sum = dyd.abs().T @ xd.abs()
    g64 = gamma(max(T, 1), UNIT_ROUNDOFF[torch.float64])
    rtol = accumulation_rtol(backend, x.dtype, T) + g64
    # A zero sum of absolute products means every product is exactly 0: so is the sum.
    # The (1 + 4 u64) factor rounds the float64 evaluation of the radius itself upward.
    radius = torch.where(abs_sum == 0, 0.0, (rtol * abs_sum * (1 + g64) + T * FP32_UNDERFLOW)
                         * (1 + 4 * UNIT_ROUNDOFF[torch.float64]))
    return Interval.around(center, radius)
