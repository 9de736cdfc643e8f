"""A numpy reference of Philox4x32-10 as Triton's ``tl.randint4x(seed, counter)`` computes
it, of stochastic rounding fp32 -> bf16 on top of it, and of the zeroth-order base's
normal draws, for bit-exact checks."""

import math

import numpy as np
import torch

_KEY_A, _KEY_B = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
_ROUND_A, _ROUND_B = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_MASK32 = np.uint64(0xFFFFFFFF)


def philox_words(seed: int, counter: np.ndarray, rounds: int = 10) -> tuple:
    """The four output words of Philox4x32 with key (seed lo, seed hi) and counter
    (c, 0, 0, 0): ``tl.randint4x(seed, counter)``."""
    c0 = np.asarray(counter, dtype=np.uint32).copy()
    c1 = np.zeros_like(c0)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    k0, k1 = np.uint32(seed & 0xFFFFFFFF), np.uint32((seed >> 32) & 0xFFFFFFFF)
    with np.errstate(over="ignore"):
        for _ in range(rounds):
            prod_b = _ROUND_B * c2.astype(np.uint64)
            prod_a = _ROUND_A * c0.astype(np.uint64)
            c0, c1, c2, c3 = ((prod_b >> np.uint64(32)).astype(np.uint32) ^ c1 ^ k0,
                              (prod_b & _MASK32).astype(np.uint32),
                              (prod_a >> np.uint64(32)).astype(np.uint32) ^ c3 ^ k1,
                              (prod_a & _MASK32).astype(np.uint32))
            k0, k1 = k0 + _KEY_A, k1 + _KEY_B
    return c0, c1, c2, c3


def philox_randint(seed: int, counter: np.ndarray, rounds: int = 10) -> np.ndarray:
    """First output word of Philox4x32: ``tl.randint(seed, counter)``."""
    return philox_words(seed, counter, rounds)[0]


def stochastic_round_reference(x: torch.Tensor, seed: int, offset: int = 0, word: int = 0,
                               pairs: bool = False) -> torch.Tensor:
    """What ``forge_kernels.stochastic_round`` must return, bit for bit; with ``word=j``,
    the rounding that draws Philox output word j instead of word 0. ``pairs=True`` is the
    fused update's bf16 draw (``forge_kernels.ops.stochastic_round.paired_words``) for a
    whole 2-D weight ``x`` (N, K): element (r, c) takes 16 bits of word j of the call at
    counter ``r * ceil(K / 2) + c // 2``, the low half for even c, the high half for odd
    c (the update rounds its weight with word 0 and state slot i with word 1 + i)."""
    bits = x.detach().cpu().contiguous().numpy().view(np.uint32).ravel().astype(np.uint64)
    if pairs:
        rows, cols = x.shape
        r, c = np.divmod(np.arange(bits.size, dtype=np.uint64), np.uint64(cols))
        counter = (r * np.uint64((cols + 1) // 2) + c // np.uint64(2) + np.uint64(offset)).astype(np.uint32)
        shift = ((c % np.uint64(2)) * np.uint64(16)).astype(np.uint32)
        noise = ((philox_words(seed, counter)[word] >> shift) & np.uint32(0xFFFF)).astype(np.uint64)
    else:
        counter = (np.arange(bits.size, dtype=np.uint64) + np.uint64(offset)).astype(np.uint32)
        noise = (philox_words(seed, counter)[word] & np.uint32(0xFFFF)).astype(np.uint64)
    rounded = ((bits + noise) & np.uint64(0xFFFF0000)).astype(np.uint32)
    is_nan = np.isnan(x.detach().cpu().contiguous().numpy().ravel())
    quiet_nan = (bits.astype(np.uint32) & np.uint32(0x80000000)) | np.uint32(0x7FC00000)
    rounded = np.where(is_nan, quiet_nan, rounded)
    halves = (rounded >> np.uint32(16)).astype(np.uint16)
    return torch.from_numpy(halves.view(np.int16).copy()).view(torch.bfloat16).reshape(x.shape)


def standard_normal_reference(key: int, counter: np.ndarray) -> np.ndarray:
    """The zeroth-order base's N(0, 1) draws, float64, straight in numpy: Box–Muller on
    Philox words 0 and 1, u1 = (w0 + 1/2) / 2**32, u2 = w1 / 2**32, with ln u1 and
    cos(2π u2) (and the square root) written out in the basic operations the library uses
    (``forge_kernels.zeroth_order.portable_math``), so the bits must agree exactly."""
    w0, w1, _, _ = philox_words(key, counter)
    u1 = (w0.astype(np.float64) + 0.5) * 2.0**-32
    u2 = w1.astype(np.float64) * 2.0**-32
    return _sqrt(-2.0 * _log(u1)) * _cos_two_pi(u2)


def _series(z, coefficients):
    acc = np.float64(coefficients[-1])
    for c in reversed(coefficients[:-1]):
        acc = c + z * acc
    return acc


def _sqrt(x):
    m, e = np.frexp(x)
    odd = e % 2 == 1
    m = np.where(odd, m * 2.0, m)
    e = e - odd
    y = (1.0 + m) * 0.5
    for _ in range(5):
        y = (y + m / y) * 0.5
    return np.ldexp(y, e // 2)


def _log(u):
    m, e = np.frexp(u)
    low = m < 0.70710678118654752440
    m = np.where(low, m * 2.0, m)
    e = (e - low).astype(np.float64)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    tail = [1.0 / (2 * k + 1) for k in range(1, 13)]
    log_m = 2.0 * s + (2.0 * s) * (z * _series(z, tail))
    return e * 6.93147180369123816490e-01 + (log_m + e * 1.90821492927058770002e-10)


def _cos_two_pi(u):
    v = u * 4.0
    k = np.floor(v)
    r = v - k
    near = r <= 0.5
    y = np.where(near, r, 1.0 - r) * (np.pi / 2)
    z = y * y
    sin_y = y + y * (z * _series(z, [(-1) ** k / math.factorial(2 * k + 1) for k in range(1, 10)]))
    cos_y = 1.0 + z * _series(z, [(-1) ** k / math.factorial(2 * k) for k in range(1, 10)])
    value = np.where((np.remainder(k, 2.0) == 0) == near, cos_y, sin_y)
    return np.where((k == 1.0) | (k == 2.0), -value, value)
