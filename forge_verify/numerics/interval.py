"""Rigorous interval enclosures in float64, modelling fp32 kernel arithmetic.

Every operation on :class:`Interval` returns an interval that contains every value
an fp32 kernel can produce for that operation from operands inside the inputs:
the exact result's range is computed in float64 and widened outward by one float64
ulp (every float64 operation used is correctly rounded: torch's +, -, *, / and numpy's
square root, see :func:`sqrt_rn`), then widened by the fp32 rounding
model |fl(z) - z| <= u|z| + FP32_UNDERFLOW, and outward again. Hence it holds for
any fp32 evaluation of the same operation sequence, fused multiply-adds included
(an FMA rounds once where the model allows twice). See proofs/reference_enclosure.md.
"""

import numpy as np
import torch

from forge_kernels import q8

from .tolerances import BF16_SUBNORMAL_SPACING, FP32_SUBNORMAL_SPACING, FP32_UNDERFLOW, UNIT_ROUNDOFF

_F64 = torch.float64
# fp32 rounding, plus slack for an implementation that evaluates in float64 and rounds
# once more to fp32 (the Triton interpreter's numpy can): a double rounding.
_OP_UNIT = UNIT_ROUNDOFF[torch.float32] + 2 * UNIT_ROUNDOFF[torch.float64]


def _down(t):
    return torch.nextafter(t, torch.full_like(t, -torch.inf))


def _up(t):
    return torch.nextafter(t, torch.full_like(t, torch.inf))


def sqrt_rn(t: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float64 square root, elementwise. torch's CPU float64 sqrt is
    not correctly rounded on every build (torch 2.13.0+cpu: sqrt(51) is one ulp low, within one ulp
    everywhere ``tests/test_interval.py`` looks);
    numpy's is (IEEE 754 requires it, and its square-root instructions are)."""
    return torch.from_numpy(np.asarray(np.sqrt(t.detach().cpu().to(_F64).numpy()))).to(t.device)


def _as_tensor(value):
    return value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=_F64)


def _q8_store_error(levels: np.ndarray, rounding: str) -> tuple:
    """(largest relative error of a q8 store between adjacent same-sign levels a < b,
    smallest nonzero level magnitude). Nearest: (b - a)/(b + a), the worst case at the
    midpoint (the kernel's comparison is exact, forge_kernels.q8). Stochastic: the value
    can go to either neighbour, so (b - a)/a."""
    levels = levels.astype(np.float64)
    positive = levels[levels > 0]
    negative = -levels[levels < 0][::-1]
    relative = max(float(np.max((m[1:] - m[:-1]) / (m[1:] + m[:-1] if rounding == "nearest" else m[:-1])))
                   for m in (positive, negative) if m.size > 1)
    smallest = float(min(positive.min(), negative.min() if negative.size else np.inf))
    return relative, smallest


_Q8_STORE_ERROR = {(signed, rounding): _q8_store_error(q8.SIGNED_LEVELS if signed else q8.UNSIGNED_LEVELS, rounding)
                   for signed in (True, False) for rounding in ("nearest", "stochastic")}


class Interval:
    """A tensor of closed intervals [lo, hi] (float64)."""

    __slots__ = ("lo", "hi")

    def __init__(self, lo, hi):
        self.lo = _as_tensor(lo).to(_F64)
        self.hi = _as_tensor(hi).to(_F64)

    @classmethod
    def exact(cls, value):
        """The degenerate interval of values known exactly (stored fp32 inputs)."""
        t = _as_tensor(value).to(_F64)
        return cls(t, t.clone())

    @classmethod
    def around(cls, center, radius):
        """[center - radius, center + radius], rounded outward (exact where radius is 0)."""
        c, r = _as_tensor(center).to(_F64), _as_tensor(radius).to(_F64)
        exact = r == 0
        return cls(torch.where(exact, c, _down(c - r)), torch.where(exact, c, _up(c + r)))

    @classmethod
    def host_scalar(cls, value: float):
        """A hyperparameter computed on the host in float64 and rounded once to fp32."""
        value = float(value)
        slack = abs(value) * (UNIT_ROUNDOFF[torch.float32] + 8 * UNIT_ROUNDOFF[torch.float64]) + FP32_UNDERFLOW
        return cls.around(value, slack)

    @staticmethod
    def _fp32_op(lo, hi):
        # Rounding is monotone and maps 0 to 0, and a float64 result has the sign of the
        # exact one, so an endpoint never needs to be widened across zero: an exact zero
        # stays exact (Lion's sign of a zero gradient must not become "either sign").
        wide_lo = _down(_down(lo) - (_OP_UNIT * lo.abs() + FP32_UNDERFLOW))
        wide_hi = _up(_up(hi) + (_OP_UNIT * hi.abs() + FP32_UNDERFLOW))
        return Interval(torch.where(lo >= 0, wide_lo.clamp_min(0), wide_lo),
                        torch.where(hi <= 0, wide_hi.clamp_max(0), wide_hi))

    @staticmethod
    def _wrap(other):
        return other if isinstance(other, Interval) else Interval.exact(other)

    def __add__(self, other):
        other = self._wrap(other)
        return self._fp32_op(self.lo + other.lo, self.hi + other.hi)

    __radd__ = __add__

    def __neg__(self):
        return Interval(-self.hi, -self.lo)

    def __sub__(self, other):
        return self + (-self._wrap(other))

    def __rsub__(self, other):
        return self._wrap(other) + (-self)

    def __mul__(self, other):
        other = self._wrap(other)
        products = torch.stack(torch.broadcast_tensors(self.lo * other.lo, self.lo * other.hi,
                                                       self.hi * other.lo, self.hi * other.hi))
        return self._fp32_op(products.amin(0), products.amax(0))

    __rmul__ = __mul__

    def __truediv__(self, other):
        other = self._wrap(other)
        # A divisor interval that reaches zero leaves the quotient unbounded.
        spans_zero = (other.lo <= 0) & (other.hi >= 0)
        quotients = torch.stack(torch.broadcast_tensors(self.lo / other.lo, self.lo / other.hi,
                                                        self.hi / other.lo, self.hi / other.hi))
        lo = torch.where(spans_zero, -torch.inf, quotients.amin(0))
        hi = torch.where(spans_zero, torch.inf, quotients.amax(0))
        return self._fp32_op(lo, hi)

    def stored(self, dtype: torch.dtype, rounding: str):
        """The interval after the value is stored as ``dtype``: unchanged for fp32 (the
        kernel's fp32 result is what is stored); for bf16, widened by half a bf16 ulp
        (nearest: u = 2^-8) or by one ulp (stochastic: |SR(z) - z| < ulp <= 2^-7 |z|),
        plus the bf16 subnormal spacing near zero. Never across zero: both roundings
        are monotone in magnitude and keep the sign."""
        if dtype == torch.float32:
            return self
        if dtype != torch.bfloat16 or rounding not in ("nearest", "stochastic"):
            raise ValueError(f"no store model for {dtype} with {rounding!r} rounding")
        u = UNIT_ROUNDOFF[torch.bfloat16]
        unit = u if rounding == "nearest" else 2 * u
        wide_lo = _down(self.lo - (unit * self.lo.abs() + BF16_SUBNORMAL_SPACING))
        wide_hi = _up(self.hi + (unit * self.hi.abs() + BF16_SUBNORMAL_SPACING))
        return Interval(torch.where(self.lo >= 0, wide_lo.clamp_min(0), wide_lo),
                        torch.where(self.hi <= 0, wide_hi.clamp_max(0), wide_hi))

    def stored_q8(self, signed: bool, rounding: str):
        """The interval after a q8 store (forge_kernels.q8): one of the two levels of the
        block's map around the value, so a relative error up to max (b - a) / (b + a) over
        adjacent same-sign levels (nearest) or (b - a) / a (stochastic), plus, for values
        under the smallest level, up to that level times the block scale (at most twice
        the block's largest magnitude). Never across zero."""
        if (signed, rounding) not in _Q8_STORE_ERROR:
            raise ValueError(f"no q8 store model for {rounding!r} rounding")
        relative, smallest = _Q8_STORE_ERROR[signed, rounding]
        magnitude = torch.maximum(self.lo.abs(), self.hi.abs())
        rows, cols = magnitude.shape
        pad = (-cols) % q8.BLOCK
        blocks = torch.nn.functional.pad(magnitude, (0, pad)).reshape(rows, -1, q8.BLOCK).amax(dim=2)
        # + 2^-149: a block below 2^-126 has its exponent clamped, and decoding rounds again
        # into the fp32 subnormals.
        floor = (2 * smallest * blocks + FP32_SUBNORMAL_SPACING).repeat_interleave(q8.BLOCK, dim=1)[:, :cols]
        wide_lo = _down(self.lo - (relative * self.lo.abs() + floor))
        wide_hi = _up(self.hi + (relative * self.hi.abs() + floor))
        return Interval(torch.where(self.lo >= 0, wide_lo.clamp_min(0), wide_lo),
                        torch.where(self.hi <= 0, wide_hi.clamp_max(0), wide_hi))

    def sqrt(self):
        # The operand of every sqrt in the rules is non-negative in exact arithmetic;
        # a lower end below zero is rounding slack and is clamped.
        return self._fp32_op(sqrt_rn(self.lo.clamp_min(0)), sqrt_rn(self.hi.clamp_min(0)))

    def clamp_nonnegative(self):
        """max(., 0): exact and monotone, so both ends clamp."""
        return Interval(self.lo.clamp_min(0), self.hi.clamp_min(0))

    def sign(self):
        """Exact: every sign the values in the interval can have."""
        lo = torch.where(self.lo > 0, 1.0, torch.where(self.lo < 0, -1.0, 0.0)).to(_F64)
        hi = torch.where(self.hi > 0, 1.0, torch.where(self.hi < 0, -1.0, 0.0)).to(_F64)
        return Interval(lo, hi)

    def contains(self, value: torch.Tensor) -> torch.Tensor:
        v = value.to(_F64)
        return (self.lo <= v) & (v <= self.hi)

    @property
    def radius(self) -> torch.Tensor:
        return (self.hi - self.lo) / 2

    def use(self, value: torch.Tensor) -> float:
        """The largest share of the proven radius ``value`` takes: max |value - centre| /
        radius over the elements (0 for an empty tensor; inf where a zero-radius element
        differs). At most 1 exactly when every element lies inside."""
        v = value.detach().cpu().to(_F64)
        distance = (v - (self.lo + self.hi) / 2).abs()
        ratio = torch.where(self.radius > 0, distance / self.radius, torch.where(distance == 0, 0.0, torch.inf))
        return float(ratio.max()) if ratio.numel() else 0.0

    def __repr__(self):
        return f"Interval(lo={self.lo}, hi={self.hi})"
