"""References of the optimizer rules and of the weight gradient.

Each rule's reference is written once, as the textbook formula in the same
operation order as the kernel, over an *arithmetic*:

* ``POINT``: float64 tensors, the slow obviously-correct reference;
* ``ENCLOSURE``: :class:`~forge_verify.numerics.interval.Interval`, a rigorous bound on
  every value an fp32 kernel evaluating that sequence can produce;
* :func:`running_error` (``RUNNING_ERROR``): the float64 reference's values, each with a
  bound on its distance to the exact value of the same sequence (how far two float64
  evaluations of one rule may differ, proofs/reference_enclosure.md).

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


class _ValueMethods:
    """The operations an arithmetic's values carry themselves (``Interval``, ``Rounded``)."""

    @staticmethod
    def sqrt(x):
        return x.sqrt()

    @staticmethod
    def sign(x):
        return x.sign()

    @staticmethod
    def clamp_nonnegative(x):
        return x.clamp_nonnegative()


class _Enclosure(_ValueMethods):
    name = "enclosure"

    @staticmethod
    def const(c):
        return Interval.host_scalar(c)

    @staticmethod
    def value(t):
        return Interval.exact(t.detach().cpu())


#: a bound's own evaluation is at most eight float64 operations on non-negative terms: seven
#: for a product (``|a| e_b + |b| e_a + e_a e_b + unit |result|``) or a quotient, then the
#: multiply by this factor. So the computed bound is at least (1 + 16 u64)(1 - u64)^8 > 1 + 7 u64
#: times its real value: an upper bound, with room for a bound taken along another evaluation's
#: values (proofs/reference_enclosure.md)
_BOUND_MARGIN = 1 + 16 * UNIT_ROUNDOFF[torch.float64]


class Rounded:
    """A float64 value and a bound on its distance to the exact (real-number) value of the
    expression it was computed by (running error analysis: Higham, *Accuracy and Stability
    of Numerical Algorithms*, section 3.3). Each operation propagates its operands' bounds
    exactly as the real operation does, then adds ``unit * |result|`` for its own rounding;
    every bound is itself evaluated with a margin that covers its float64 roundings."""

    __slots__ = ("value", "error", "unit")

    def __init__(self, value, error, unit):
        self.value, self.error, self.unit = value, error, unit

    def _result(self, value, propagated):
        return Rounded(value, (propagated + self.unit * value.abs()) * _BOUND_MARGIN, self.unit)

    def __add__(self, other):
        return self._result(self.value + other.value, self.error + other.error)

    def __sub__(self, other):
        return self._result(self.value - other.value, self.error + other.error)

    def __mul__(self, other):
        return self._result(self.value * other.value, self.value.abs() * other.error
                            + other.value.abs() * self.error + self.error * other.error)

    def __truediv__(self, other):
        # |a/b - â/b̂| <= (e_a + |â/b̂| e_b) / |b|, and |b| >= |b̂| - e_b; unbounded if that reaches 0.
        quotient = self.value / other.value
        floor = torch.nextafter(other.value.abs() - other.error, torch.tensor(-torch.inf, dtype=torch.float64))
        spread = (self.error + quotient.abs() * (1 + self.unit) * other.error) / floor
        return self._result(quotient, torch.where(floor > 0, spread, torch.inf))

    def sqrt(self):
        # |√a - √â| = |a - â| / (√a + √â) <= e / √â, and never more than √e.
        root = sqrt_rn(self.value)
        shrunk = torch.where(root > 0, self.error / root, torch.inf)
        return self._result(root, torch.minimum(shrunk, sqrt_rn(self.error)))

    def sign(self):
        # Exact where the bound cannot reach zero; elsewhere the sign may be off by up to 2.
        exact = (self.value.abs() > self.error) | (self.error == 0)
        error = torch.where(exact, 0.0, 2.0).to(torch.float64)
        return Rounded(torch.sign(self.value), error, self.unit)

    def clamp_nonnegative(self):
        return Rounded(self.value.clamp_min(0), self.error, self.unit)  # 1-Lipschitz, exact


class _RunningError(_ValueMethods):
    """Float64 values with running error bounds (:class:`Rounded`); each operation and each
    host scalar may be off by ``unit`` relatively: gamma_1(u64) for correctly rounded ones."""

    def __init__(self, unit: float):
        self.name, self.unit = f"fp64 running error (unit {unit:.3g})", unit

    def const(self, c):
        # a host scalar, allowed one rounding: two evaluations of a rule compute the same
        # scalars from the hyperparameters but for a square root (proofs/reference_enclosure.md)
        value = torch.tensor(float(c), dtype=torch.float64)
        return Rounded(value, self.unit * value.abs(), self.unit)

    def value(self, t):
        """An input known exactly."""
        t = t.detach().to(torch.float64)
        return Rounded(t, torch.zeros_like(t), self.unit)


def running_error(rounded_operations: int = 1) -> _RunningError:
    """The arithmetic whose every operation (and host scalar) is allowed the error of
    ``rounded_operations`` float64 roundings, gamma_n(u64): 1 models correctly rounded
    float64 (this module's ``POINT``), 2 an operation within one float64 ulp."""
    return _RunningError(gamma(rounded_operations, UNIT_ROUNDOFF[torch.float64]))


POINT = _Point()
ENCLOSURE = _Enclosure()
RUNNING_ERROR = running_error()
#: torch.optim's float64 evaluation (its single-tensor code): every operation within one
#: float64 ulp (proofs/reference_enclosure.md, "Two float64 evaluations of one rule")
TORCH_OPTIM = running_error(2)


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


def weight_grad_radius(x: torch.Tensor, dy: torch.Tensor, backend: str) -> torch.Tensor:
    """A float64 bound, per element, on how far the fp32 dW the kernel computes on ``backend``
    from ``x`` (T, n) and ``dy`` (T, m) lies from dyᵀx, exact or evaluated in float64 alike.

    |fp32 sum - exact| <= accumulation_rtol * S and |float64 sum - exact| <= gamma_T(u64) * S,
    with S = sum_t |dy_ti x_tj| (itself computed in float64, so inflated by gamma_T(u64)).
    """
    T = x.shape[0]
    xd, dyd = x.detach().cpu().to(torch.float64), dy.detach().cpu().to(torch.float64)
    abs_sum = dyd.abs().T @ xd.abs()
    g64 = gamma(max(T, 1), UNIT_ROUNDOFF[torch.float64])
    rtol = accumulation_rtol(backend, x.dtype, T) + g64
    # A zero sum of absolute products means every product is exactly 0: so is the sum.
    # The (1 + 4 u64) factor rounds the float64 evaluation of the radius itself upward.
    return torch.where(abs_sum == 0, 0.0, (rtol * abs_sum * (1 + g64) + T * FP32_UNDERFLOW)
                       * (1 + 4 * UNIT_ROUNDOFF[torch.float64]))


def weight_grad_enclosure(x: torch.Tensor, dy: torch.Tensor, backend: str) -> Interval:
    """An interval containing every fp32 dW the kernel can compute on ``backend``: the
    float64 dyᵀx widened by ``weight_grad_radius``."""
    return Interval.around(weight_grad(x, dy), weight_grad_radius(x, dy, backend))
