"""``div_by_scalar_rn`` (a float64 reciprocal, one multiply) gives ``tl.div_rn``'s bits
under its stated conditions (proofs/scalar_division.md): on the CPU against numpy's IEEE
float32 division on sampled and adversarial dividends, and on a GPU for every
non-negative float32 bit pattern, against the hardware's correctly rounded division."""

import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import forge_kernels as fk
from forge_kernels.rules.base import bias_corrections
from forge_kernels.rules.scalar_division import div_by_scalar_rn, reciprocal_f64

SMALLEST_NORMAL_BITS = 0x00800000


def _divisors():
    """AdamW's bias corrections for common betas and steps, the extremes of their range
    (sqrt(2**-53) rounded to float32, 1, just below 1), and divisors whose significands are
    all ones or a power of two."""
    values = {bias_corrections(0.9, beta2, step)[1] for beta2 in (0.95, 0.99, 0.999, 0.9999, 0.999999)
              for step in (1, 2, 3, 10, 1000, 10**6)}
    values |= {math.sqrt(2.0**-53), 1.0, 1.0 - 2.0**-24, 0.75, 2.0**-10, (2.0 - 2.0**-23) * 2.0**-5}
    return sorted(float(np.float32(v)) for v in values)


@triton.jit
def _divide_kernel(x_ptr, out_ptr, n, c, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, div_by_scalar_rn(x, reciprocal_f64(c)), mask=mask)


def _tightest_dividends(c: float) -> np.ndarray:
    """Dividends whose quotients by c come as close to a float32 rounding boundary as two
    float32 values allow: |x/c - m| = 2**(k-24) / C (the proof's bound with |N| = 1), from
    X 2**s - C M = ±1 solved modulo 2**s (C odd), for s = 24 and 25, at several exponents."""
    C = int(math.frexp(c)[0] * 2**24)
    if C % 2 == 0:  # N = X 2**s - C M is then even: |N| = 1 cannot occur
        return np.zeros(0, dtype=np.float32)
    out = []
    for s in (24, 25):
        inverse = pow(C, -1, 2**s)
        for sign in (1, -1):
            residue = (-sign * inverse) % 2**s
            for M in range(residue, 2**25, 2**s):
                X, remainder = divmod(C * M + sign, 2**s)
                if M > 2**24 and M % 2 == 1 and remainder == 0 and 2**23 <= X < 2**24:
                    out += [X * 2.0 ** (a - 23) for a in (-60, -20, 0, 20, 60)]
    return np.array(out, dtype=np.float32)


def _dividends(c: float, count: int, seed: int) -> np.ndarray:
    """Random bit patterns over every exponent whose quotient by c is normal, and the float32
    neighbours of c times quotient midpoints (the dividends whose quotients come closest to a
    rounding boundary), plus zeros and infinities."""
    rng = np.random.default_rng(seed)
    low = max(SMALLEST_NORMAL_BITS, int(np.float32(2.0**-126 * c * 2).view(np.uint32)))
    high = int(np.float32(3.0e38).view(np.uint32))
    random = rng.integers(low, high, count, dtype=np.uint32).view(np.float32)
    midpoints = (rng.integers(2**24, 2**25, count // 2) | 1).astype(np.float64) * 2.0 ** rng.integers(-120, 100, count // 2)
    near = (midpoints * c).astype(np.float32)
    neighbours = np.concatenate([near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(0))])
    special = np.array([0.0, -0.0, np.inf, -np.inf], dtype=np.float32)
    x = np.concatenate([random, -random[:100], neighbours, _tightest_dividends(c), special]).astype(np.float32)
    quotient = np.abs(x.astype(np.float64) / c)
    keep = (quotient == 0) | np.isinf(quotient) | ((quotient >= 2.0**-126) & (quotient < 3.0e38))
    return x[keep & (np.abs(x) >= 2.0**-126) | (x == 0) | np.isinf(x)]


@pytest.mark.parametrize("c", _divisors()[::3])
def test_matches_ieee_division_on_sampled_and_adversarial_dividends(c):
    x = _dividends(c, 4096, seed=int(np.float32(c).view(np.uint32)))
    device = fk.kernel_device()
    xt = torch.from_numpy(x).to(device)
    out = torch.empty_like(xt)
    _divide_kernel[(triton.cdiv(x.size, 1024),)](xt, out, x.size, c, BLOCK=1024)
    expected = x / np.float32(c)  # numpy's float32 division: IEEE, correctly rounded
    got = out.cpu().numpy()
    differ = got.view(np.uint32) != expected.view(np.uint32)
    assert not differ.any(), (f"{int(differ.sum())} of {x.size} quotients by {c!r} differ, e.g. "
                              f"x={x[differ][:3]!r}: {got[differ][:3]!r} against {expected[differ][:3]!r}")


@triton.jit
def _count_mismatches_kernel(count_ptr, first, total, c, BLOCK: tl.constexpr):
    """Every float32 bit pattern first .. first + total - 1 (non-negative) as a dividend;
    counts the patterns inside the claim's domain whose two quotients differ in any bit."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    bits = (first + offs).to(tl.uint32)
    x = bits.to(tl.float32, bitcast=True)
    fast = div_by_scalar_rn(x, reciprocal_f64(c))
    exact = tl.div_rn(x, c)
    ok_domain = (x == 0) | (tl.abs(x) > 3.4028234663852886e38) | ((bits >= 0x00800000) & (tl.abs(exact) >= 1.1754943508222875e-38))
    both_nan = (fast != fast) & (exact != exact)
    differ = (fast.to(tl.uint32, bitcast=True) != exact.to(tl.uint32, bitcast=True)) & ~both_nan
    tl.atomic_add(count_ptr, tl.sum((differ & ok_domain & (offs < total)).to(tl.int32), axis=0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the exhaustive check runs 2**31 dividends per divisor: "
                                                            "a GPU's work, hours in the interpreter")
def test_every_non_negative_dividend_matches_div_rn_on_the_gpu():
    block = 1024
    for c in _divisors():
        count = torch.zeros(1, dtype=torch.int32, device="cuda")
        chunk = 2**30
        for first in range(0, 2**31, chunk):
            _count_mismatches_kernel[(chunk // block,)](count, first, chunk, c, BLOCK=block)
        assert int(count.item()) == 0, f"{int(count.item())} dividends by {c!r} differ from tl.div_rn"
