"""Division of a tile by one positive scalar, correctly rounded, at the cost of a multiply.

``tl.div_rn(x, c)`` compiles on NVIDIA GPUs to a reciprocal, five fused multiply-adds, a
range check and a slow-path branch for every element, even when ``c`` is one value for
the whole tile (seen in the SASS of the AdamW epilogue on sm_90: about 12 instructions per
element, with the reciprocal of the constant recomputed each time). Here the reciprocal
is computed once, in float64, and each element takes one widening conversion, one float64
multiply and one narrowing conversion:

    q = RN32(RN64(x · RN64(1 / c)))

which is ``RN32(x / c)``, the bits of ``tl.div_rn(x, c)``, whenever ``c`` is a positive
normal float32 and ``x`` is zero, non-finite, or a normal float32 whose quotient ``x / c``
is normal (proofs/scalar_division.md: the float64 result is within 2^-51.99 relative of
x / c, and a quotient of two float32 values that is not a float32 value lies at least
2^-49 relative from every rounding boundary). Outside those conditions it is not used:
callers state why their operands satisfy them.
"""

import triton
import triton.language as tl


@triton.jit
def reciprocal_f64(c):
    """RN64(1 / c) for a positive normal float32 scalar ``c``. A Python float (the
    interpreter passes scalar arguments so) is first rounded to float32, as a kernel
    argument is. Float64 division compiles to PTX's ``div.rn.f64`` (there is no
    approximate float64 division) and is numpy's IEEE division in the interpreter."""
    return 1.0 / tl.cast(c, tl.float64)


@triton.jit
def div_by_scalar_rn(x, reciprocal):
    """``tl.div_rn(x, c)``'s bits for an fp32 tile ``x``, given ``reciprocal_f64(c)``,
    under the conditions of the module docstring."""
    return (x.to(tl.float64) * reciprocal).to(tl.float32)
