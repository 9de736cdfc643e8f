"""Arbitrary-precision references: the exact gradient (rational arithmetic) and the
rule in mpmath at 113 bits, through the same generic references as the float64 and
interval arithmetics (forge_verify.numerics.reference).

The precision is set in a local context and restored on exit. Hyperparameter-derived
constants (bias corrections, 1 - beta) enter as the float64 values the host computes,
read exactly; they differ from the real numbers by at most 2^-53 relatively, far below
every error this module is used to measure.
"""

from fractions import Fraction

import mpmath
import numpy as np
import torch

PRECISION_BITS = 113

_sqrt = np.vectorize(mpmath.sqrt, otypes=[object])
_sign = np.vectorize(lambda v: mpmath.mpf(mpmath.sign(v)), otypes=[object])
_clamp = np.vectorize(lambda v: max(v, mpmath.mpf(0)), otypes=[object])


class _MP:
    """Elementwise mpmath arithmetic over numpy object arrays of mpf."""

    name = "mpmath"

    @staticmethod
    def const(c):
        return mpmath.mpf(float(c))

    @staticmethod
    def value(t):
        return np.vectorize(mpmath.mpf, otypes=[object])(t.detach().cpu().double().numpy())

    @staticmethod
    def sqrt(x):
        return _sqrt(x)

    @staticmethod
    def sign(x):
        return _sign(x)

    @staticmethod
    def clamp_nonnegative(x):
        return _clamp(x)


MPMATH = _MP()


def exact_weight_grad(x: torch.Tensor, dy: torch.Tensor) -> np.ndarray:
    """dW = dyᵀ x summed exactly in rationals, then rounded once to 113 bits (object array).
    Must be called inside ``mpmath.workprec(PRECISION_BITS)``."""
    xs = x.detach().cpu().double().numpy()
    dys = dy.detach().cpu().double().numpy()
    T, K = xs.shape
    N = dys.shape[1]
    out = np.empty((N, K), dtype=object)
    # float64 products of fp32/bf16 values are exact; their rational sum is exact.
    products = dys.T[:, :, None] * xs[None, :, :]  # (N, T, K)
    for i in range(N):
        for j in range(K):
            total = sum((Fraction(p) for p in products[i, :, j]), Fraction(0))
            out[i, j] = mpmath.mpf(total.numerator) / total.denominator
    return out


def to_float64(values: np.ndarray) -> np.ndarray:
    return np.vectorize(float, otypes=[np.float64])(values)
