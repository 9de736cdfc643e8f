"""The zeroth-order draws as one Triton kernel: the same bits as ``draws.py``'s torch path.

``draws.py`` computes Philox4x32-10 with int64 torch operations and the normal with
``portable_math``'s float64 Box–Muller: hundreds of elementwise kernels over every
block of U. Here one program draws a whole tile in registers:

* the words are ``tl.randint4x(key, counter)`` with a 32-bit counter, which is the
  Philox that ``draws.philox4x32`` writes out (tests/test_zeroth_order_kernels.py
  checks the words against it and against the numpy reference);
* the normal is ``portable_math``'s sequence, operation for operation: frexp and ldexp
  by exponent-field bit manipulation (exact for the positive normal numbers they see),
  Newton's square root, the atanh series for ln, the quadrant fold and the sin/cos
  series for cos(2πu), the same Horner order, then one rounding to the output dtype.
  The quadrant k = floor(4 u2) is taken as ``w1 >> 30``: 4 u2 = w1 / 2**30 exactly, so
  it is the same number. Every constant that is not exact in float32 (ln 2's halves,
  √½, π/2, the series' coefficients) is read from a float64 table, so no version of
  Triton can round a Python float literal to float32 on the way in;
* kernels launch with ``enable_fp_fusion=False``: no multiply–add is contracted into an
  FMA, so every operation rounds once, as torch's separate elementwise kernels do.
  float64 ``/`` is IEEE division on every backend (NVPTX lowers it to ``div.rn.f64``;
  the interpreter is numpy).

Counters are checked by the caller (``draws.py``): every counter passed here is below 2**32.
"""

import functools

import torch
import triton
import triton.language as tl

from .._backend import on_device
from . import portable_math

#: output dtypes the kernel writes: a normal rounded once from float64 to float32 or
#: float64 (bfloat16 would need float64 -> bfloat16 in one rounding, which no path here
#: needs: bf16 parameters draw in float32); signs are ±1, exact in every one of these
NORMAL_DTYPES = (torch.float32, torch.float64)
SIGN_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
BLOCK = 1024

# positions in the constant table
_SQRT_HALF, _LN2_HI, _LN2_LO, _HALF_PI = 0, 1, 2, 3
_ATANH = 4
_SIN = _ATANH + len(portable_math.ATANH_TAIL)
_COS = _SIN + len(portable_math.SIN_TAIL)
N_ATANH = len(portable_math.ATANH_TAIL)
N_SIN = len(portable_math.SIN_TAIL)
N_COS = len(portable_math.COS_TAIL)


def constant_values() -> list:
    """The float64 constants of ``portable_math`` in the table's order."""
    return [portable_math.SQRT_HALF, portable_math.LN2_HI, portable_math.LN2_LO, portable_math.HALF_PI,
            *portable_math.ATANH_TAIL, *portable_math.SIN_TAIL, *portable_math.COS_TAIL]


@functools.lru_cache(maxsize=16)
def constant_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(constant_values(), dtype=torch.float64, device=device)


@triton.jit
def _frexp(x):
    """(m, e) with x = m · 2**e, m in [1/2, 1), for positive normal float64 x: torch.frexp."""
    bits = x.to(tl.int64, bitcast=True)
    e = ((bits >> 52) & 0x7FF).to(tl.int32) - 1022
    m = ((bits & 0x000FFFFFFFFFFFFF) | 0x3FE0000000000000).to(tl.float64, bitcast=True)
    return m, e


@triton.jit
def _pow2(e):
    """2**e as float64 for int32 e in the normal range (exact): ldexp's factor."""
    return ((e + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _horner(z, table_ptr, FIRST: tl.constexpr, COUNT: tl.constexpr):
    """c0 + z·(c1 + z·(...)) over table[FIRST : FIRST + COUNT], innermost first: ``portable_math.horner``."""
    acc = z * tl.load(table_ptr + FIRST + COUNT - 1)
    acc = tl.load(table_ptr + FIRST + COUNT - 2) + acc
    for i in tl.static_range(COUNT - 2):
        acc = tl.load(table_ptr + FIRST + COUNT - 3 - i) + z * acc
    return acc


@triton.jit
def _sqrt(x):
    """``portable_math.sqrt``."""
    m, e = _frexp(x)
    odd = (e & 1) == 1
    m = tl.where(odd, m * 2.0, m)
    e = e - odd.to(tl.int32)
    y = (1.0 + m) * 0.5
    for _ in tl.static_range(5):
        y = (y + m / y) * 0.5
    return y * _pow2(e // 2)


@triton.jit
def _log(u, table_ptr, ATANH: tl.constexpr, N_ATANH: tl.constexpr):
    """``portable_math.log``."""
    m, e = _frexp(u)
    low = m < tl.load(table_ptr + 0)
    m = tl.where(low, m * 2.0, m)
    e = (e - low.to(tl.int32)).to(tl.float64)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    log_m = 2.0 * s + (2.0 * s) * (z * _horner(z, table_ptr, ATANH, N_ATANH))
    return e * tl.load(table_ptr + 1) + (log_m + e * tl.load(table_ptr + 2))


@triton.jit
def _cos_two_pi(w1, table_ptr, SIN: tl.constexpr, N_SIN: tl.constexpr, COS: tl.constexpr, N_COS: tl.constexpr):
    """``portable_math.cos_two_pi`` of u = w1 / 2**32."""
    v = w1.to(tl.float64) * 2.0**-32 * 4.0
    quadrant = (w1 >> 30).to(tl.int32)
    r = v - quadrant.to(tl.float64)
    near = r <= 0.5
    t = tl.where(near, r, 1.0 - r)
    y = t * tl.load(table_ptr + 3)
    z = y * y
    sin_y = y + y * (z * _horner(z, table_ptr, SIN, N_SIN))
    cos_y = 1.0 + z * _horner(z, table_ptr, COS, N_COS)
    even = (quadrant & 1) == 0
    value = tl.where(even == near, cos_y, sin_y)
    return tl.where((quadrant == 1) | (quadrant == 2), -value, value)


@triton.jit
def normal_from_words(w0, w1, table_ptr):
    """N(0, 1) in float64 from Philox words 0 and 1: ``draws.standard_normal`` before its rounding."""
    u1 = (w0.to(tl.float64) + 0.5) * 2.0**-32
    radius = _sqrt(-2.0 * _log(u1, table_ptr, 4, 12))
    return radius * _cos_two_pi(w1, table_ptr, 16, 9, 25, 9)


@triton.jit
def sign_from_word(w0):
    """±1.0 (float32) from Philox word 0: its top bit 1 gives -1 (``draws.rademacher``)."""
    return tl.where((w0 >> 31) != 0, -1.0, 1.0)


@triton.jit
def grid_counter(row, k, row_offset, full_cols, col_offset):
    """The counter of element (row, k): (row_offset + row) · full_cols + col_offset + k, as
    ``draws.base_rows`` and ``draws.example_signs`` number them (int64 in, uint32 out)."""
    return ((row + row_offset) * full_cols + col_offset + k).to(tl.uint32)


@triton.jit(do_not_specialize=["n", "start", "cols", "row_offset", "full_cols", "col_offset", "key"])
def _draw_kernel(out_ptr, rows_ptr, table_ptr, n, start, cols, row_offset, full_cols, col_offset, key,
                 NORMAL: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    f = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = f < n
    g = start + f
    j = g // cols
    k = g - j * cols
    if HAS_ROWS:
        row = tl.load(rows_ptr + j, mask=mask, other=0).to(tl.int64)
    else:
        row = j
    w0, w1, _, _ = tl.randint4x(key, grid_counter(row, k, row_offset, full_cols, col_offset))
    if NORMAL:
        value = normal_from_words(w0, w1, table_ptr)
    else:
        value = sign_from_word(w0)
    tl.store(out_ptr + f, value.to(out_ptr.dtype.element_ty), mask=mask)


# the positions normal_from_words hard-codes (constexpr arguments of a jit helper must be
# literals in every Triton version used here); checked once at import
assert (_ATANH, N_ATANH, _SIN, N_SIN, _COS, N_COS) == (4, 12, 16, 9, 25, 9)
assert (_SQRT_HALF, _LN2_HI, _LN2_LO, _HALF_PI) == (0, 1, 2, 3)


def draw(kind_normal: bool, key: int, n: int, dtype, device, *, rows=None, start=0, cols=1,
         row_offset=0, full_cols=1, col_offset=0) -> torch.Tensor:
    """n draws (normals, or signs when ``kind_normal`` is False), flat: output f is local
    element g = start + f of a matrix with ``cols`` columns, row j = g // cols, column
    k = g % cols, at counter (row_offset + R[j]) · full_cols + col_offset + k with R the
    ``rows`` tensor (local row indices) or the identity when ``rows`` is None."""
    allowed = NORMAL_DTYPES if kind_normal else SIGN_DTYPES
    if dtype not in allowed:
        raise TypeError(f"the draw kernel writes {allowed}, not {dtype}")
    out = torch.empty(n, dtype=dtype, device=device)
    if n == 0:
        return out
    rows_arg = out if rows is None else rows.to(device=device, dtype=torch.int64).contiguous()
    with on_device(out.device):
        _draw_kernel[(triton.cdiv(n, BLOCK),)](
            out, rows_arg, constant_table(out.device), n, start, max(cols, 1), row_offset, full_cols,
            col_offset, key, NORMAL=kind_normal, HAS_ROWS=rows is not None, BLOCK=BLOCK,
            enable_fp_fusion=False)
    return out
