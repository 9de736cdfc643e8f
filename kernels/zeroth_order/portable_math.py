"""√x, ln u and cos(2πu) in float64 from +, −, ×, ÷ alone, in one fixed order.

torch's (and numpy's, and CUDA's) ``log`` and ``cos`` are chosen per instruction set and
device and may differ in the last float64 bit, and so does torch's CPU ``sqrt``, which is
not correctly rounded (seen here: 40 of 3,000 float64 square roots one ulp off, where
numpy's were all correctly rounded); the zeroth-order base U must not (the same seed
gives the same draws on every machine). These evaluate both with correctly rounded
basic operations and exact scalings only, so every IEEE-754 backend gives the same bits
(``forge_verify.numerics.philox.standard_normal_reference`` repeats the sequence in numpy;
tests/test_zeroth_order.py compares them bit for bit and bounds the error against math's).
Each is accurate to a few float64 ulps, far below the rounding to the working dtype.
"""

import math

import torch

#: fdlibm's split of ln 2: LN2_HI has 21 trailing zero bits, so e · LN2_HI is exact for |e| < 2**21
LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
SQRT_HALF = 0.70710678118654752440
#: ln m = 2 atanh s = 2s + 2s·z·(1/3 + z/5 + ...), z = s², |s| <= 0.1716: 12 terms reach 2**-53
ATANH_TAIL = tuple(1.0 / (2 * k + 1) for k in range(1, 13))
HALF_PI = math.pi / 2
#: sin y = y + y·z·(−1/3! + z/5! − ...), cos y = 1 + z·(−1/2! + z/4! − ...), z = y², y <= π/4
SIN_TAIL = tuple((-1) ** k / math.factorial(2 * k + 1) for k in range(1, 10))
COS_TAIL = tuple((-1) ** k / math.factorial(2 * k) for k in range(1, 10))


def horner(z, coefficients):
    """c0 + z·(c1 + z·(c2 + ...)), innermost first."""
    acc = coefficients[-1]
    for c in reversed(coefficients[:-1]):
        acc = c + z * acc
    return acc


#: Newton steps for √m from (1 + m)/2 on m in [1/2, 2): the relative error goes 6e-2,
#: 2e-3, 2e-6, 1e-12, 1e-24; the fifth step only absorbs rounding
SQRT_STEPS = 5


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """√x for positive normal float64 ``x``: x = m · 2**e exactly with e even and m in
    [1/2, 2), Newton's y ← (y + m/y)/2 a fixed number of times, then the exact scaling by
    2**(e/2). Within one ulp of √x (not always the correctly rounded one), the same bits
    everywhere."""
    m, e = torch.frexp(x)
    odd = torch.remainder(e, 2) == 1
    m = torch.where(odd, m * 2.0, m)
    e = e - odd.to(e.dtype)
    y = (1.0 + m) * 0.5
    for _ in range(SQRT_STEPS):
        y = (y + m / y) * 0.5
    return torch.ldexp(y, torch.div(e, 2, rounding_mode="floor"))


def log(u: torch.Tensor) -> torch.Tensor:
    """ln u for positive normal float64 ``u``: u = m · 2**e exactly (frexp), m moved into
    [√½, √2) by an exact doubling, then ln m = 2 atanh((m − 1)/(m + 1)) by its series."""
    m, e = torch.frexp(u)
    low = m < SQRT_HALF
    m = torch.where(low, m * 2.0, m)
    e = (e - low.to(e.dtype)).to(torch.float64)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    log_m = 2.0 * s + (2.0 * s) * (z * horner(z, ATANH_TAIL))
    return e * LN2_HI + (log_m + e * LN2_LO)


def cos_two_pi(u: torch.Tensor) -> torch.Tensor:
    """cos(2πu) for float64 ``u`` in [0, 1) with at most 50 significant bits (4u and its
    parts are then exact): the quadrant k and fraction r of 4u, folded to t = min(r, 1 − r)
    so the series runs on y = (π/2)·t <= π/4, then the quadrant's sign and cofunction."""
    v = u * 4.0
    k = torch.floor(v)
    r = v - k
    near = r <= 0.5
    t = torch.where(near, r, 1.0 - r)
    y = t * HALF_PI
    z = y * y
    sin_y = y + y * (z * horner(z, SIN_TAIL))
    cos_y = 1.0 + z * horner(z, COS_TAIL)
    even = torch.remainder(k, 2.0) == 0
    value = torch.where(even == near, cos_y, sin_y)
    return torch.where((k == 1.0) | (k == 2.0), -value, value)
