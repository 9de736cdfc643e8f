"""The q8 state format inside kernels: decode a tile's codes, encode a tile's values.
The format itself (levels, blocks, exponents) and its host reference are in
``forge_kernels.q8``; this is the same arithmetic, tile by tile."""

import triton
import triton.language as tl

from ..q8 import (BLOCK, MAX_EXPONENT, MIN_EXPONENT, RANDOM_BITS, SIGNED_LEVELS_PER_OCTAVE,
                  UNSIGNED_LEVELS_PER_OCTAVE)

Q8_BLOCK = tl.constexpr(BLOCK)
Q8_MIN_EXPONENT = tl.constexpr(MIN_EXPONENT)
Q8_MAX_EXPONENT = tl.constexpr(MAX_EXPONENT)
#: 2**MAX_EXPONENT: a block whose largest magnitude reaches it would need a clamped exponent
Q8_LARGEST_EXPONENT_VALUE = tl.constexpr(2.0**MAX_EXPONENT)
Q8_RANDOM_BITS = tl.constexpr(RANDOM_BITS)
Q8_SIGNED_PER_OCTAVE = tl.constexpr(float(SIGNED_LEVELS_PER_OCTAVE))
Q8_UNSIGNED_PER_OCTAVE = tl.constexpr(float(UNSIGNED_LEVELS_PER_OCTAVE))
Q8_RANDOM_SCALE = tl.constexpr(float(2**RANDOM_BITS))


@triton.jit
def _power_of_two(e):
    """2**e as fp32 for an int32 tile e in [-126, 127], from its bits."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def q8_decode(codes_ptr, exp_ptr, table_ptr, idx, eidx, mask, SIGNED: tl.constexpr):
    code = tl.load(codes_ptr + idx, mask=mask, other=0).to(tl.int32)
    e = tl.load(exp_ptr + eidx, mask=mask, other=0).to(tl.int32)
    level = tl.load(table_ptr + (0 if SIGNED else 256) + code, mask=mask, other=0.0)
    return level * _power_of_two(e)


@triton.jit
def _estimated_code(u, SIGNED: tl.constexpr):
    """Within one of the index of the last level <= u (forge_kernels.q8's maps); u lies in
    [-1, 1]. The final clamp to [0, 255] also keeps the table reads in bounds for a NaN u,
    whose tile the epilogue will not store but still encodes."""
    # t = PER_OCTAVE * -log2|u|, capped so that u = 0 (t = inf) stays finite.
    magnitude = tl.maximum(tl.abs(u), 1e-30)
    if SIGNED:
        t = tl.minimum(-Q8_SIGNED_PER_OCTAVE * tl.log2(magnitude), 200.0)
        # u > 0: level 128 + j is 2**(-(127 - j)/6), the last one <= u has j = 127 - ceil(t);
        # u < 0: level i is -2**(-i/6), the last one <= u has i = floor(t); u = 0: level 128.
        positive = 128 + tl.maximum(127 - tl.ceil(t).to(tl.int32), 0)
        negative = tl.minimum(tl.floor(t).to(tl.int32), 127)
        code = tl.where(u > 0, positive, tl.where(u < 0, negative, 128))
    else:
        # level i >= 1 is 2**(-(255 - i)/7): the last one <= u has i = 255 - ceil(t); u = 0: 0.
        t = tl.minimum(-Q8_UNSIGNED_PER_OCTAVE * tl.log2(magnitude), 400.0)
        code = tl.where(u > 0, tl.maximum(255 - tl.ceil(t).to(tl.int32), 0), 0)
    return tl.minimum(tl.maximum(code, 0), 255)


@triton.jit
def q8_encode(v, table_ptr, word, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              SIGNED: tl.constexpr, STOCHASTIC: tl.constexpr):
    """(codes uint8 (BLOCK_N, BLOCK_K), exponents int8 (BLOCK_N, BLOCK_K // 32)) of an fp32 tile
    whose lanes outside the matrix hold 0; stochastic codes decide with the top bits of
    each element's random uint32 ``word``."""
    blocks = tl.reshape(tl.abs(v), (BLOCK_N, BLOCK_K // Q8_BLOCK, Q8_BLOCK))
    bits = tl.max(blocks, axis=2).to(tl.uint32, bitcast=True)
    e = ((bits >> 23) & 0xFF).to(tl.int32) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.minimum(tl.maximum(e, Q8_MIN_EXPONENT), Q8_MAX_EXPONENT)
    inverse = tl.broadcast_to(tl.expand_dims(_power_of_two(-e), 2), (BLOCK_N, BLOCK_K // Q8_BLOCK, Q8_BLOCK))
    u = v * tl.reshape(inverse, (BLOCK_N, BLOCK_K))
    levels = table_ptr + (0 if SIGNED else 256)
    # The lower bracketing level (the last of the 256 ascending levels <= u): estimated
    # from log2 |u| (levels are 2**(-j / PER_OCTAVE)), then corrected by exact comparisons
    # with the table, one step down and one step up, which absorbs the estimate's error
    # (the rounding of log2 and of the levels moves it by at most one code). Four table
    # reads instead of a ten-read binary search.
    code = _estimated_code(u, SIGNED)
    code = tl.where(tl.load(levels + code) > u, code - 1, code)
    code = tl.where(tl.load(levels + tl.minimum(code + 1, 255)) <= u, tl.minimum(code + 1, 255), code)
    lower = tl.load(levels + code)
    upper = tl.load(levels + tl.minimum(code + 1, 255))
    above = u - lower      # exact, and so is gap - above = upper - u (q8.py)
    gap = upper - lower
    if STOCHASTIC:
        r = (word >> (32 - Q8_RANDOM_BITS)).to(tl.float64)
        up = r * gap.to(tl.float64) < above.to(tl.float64) * Q8_RANDOM_SCALE
    else:
        up = above > gap - above
    return (code + up.to(tl.int32)).to(tl.uint8), e.to(tl.int8)
