"""The q8 state format inside kernels: decode a tile's codes, encode a tile's values.
The format itself (levels, blocks, exponents) and its host reference are in
``forge_kernels.q8``; this is the same arithmetic, tile by tile."""

import triton
import triton.language as tl

from ..q8 import BLOCK, MAX_EXPONENT, MIN_EXPONENT, RANDOM_BITS

Q8_BLOCK = tl.constexpr(BLOCK)
Q8_MIN_EXPONENT = tl.constexpr(MIN_EXPONENT)
Q8_MAX_EXPONENT = tl.constexpr(MAX_EXPONENT)
Q8_RANDOM_BITS = tl.constexpr(RANDOM_BITS)
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
def q8_encode(v, table_ptr, seed, counter, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              SIGNED: tl.constexpr, STOCHASTIC: tl.constexpr):
    """(codes uint8 (BLOCK_N, BLOCK_K), exponents int8 (BLOCK_N, BLOCK_K // 32)) of an fp32 tile
    whose lanes outside the matrix hold 0; stochastic codes draw Philox bits at ``counter``."""
    blocks = tl.reshape(tl.abs(v), (BLOCK_N, BLOCK_K // Q8_BLOCK, Q8_BLOCK))
    bits = tl.max(blocks, axis=2).to(tl.uint32, bitcast=True)
    e = ((bits >> 23) & 0xFF).to(tl.int32) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.minimum(tl.maximum(e, Q8_MIN_EXPONENT), Q8_MAX_EXPONENT)
    inverse = tl.broadcast_to(tl.expand_dims(_power_of_two(-e), 2), (BLOCK_N, BLOCK_K // Q8_BLOCK, Q8_BLOCK))
    u = v * tl.reshape(inverse, (BLOCK_N, BLOCK_K))
    levels = table_ptr + (0 if SIGNED else 256)
    # The lower bracketing level: the last of the 256 ascending levels <= u, by binary search.
    code = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
    for i in tl.static_range(8):
        step = 128 >> i
        code = tl.where(tl.load(levels + code + step) <= u, code + step, code)
    lower = tl.load(levels + code)
    upper = tl.load(levels + tl.minimum(code + 1, 255))
    above = u - lower      # exact, and so is gap - above = upper - u (q8.py)
    gap = upper - lower
    if STOCHASTIC:
        r = (tl.randint(seed, counter) >> (32 - Q8_RANDOM_BITS)).to(tl.float64)
        up = r * gap.to(tl.float64) < above.to(tl.float64) * Q8_RANDOM_SCALE
    else:
        up = above > gap - above
    return (code + up.to(tl.int32)).to(tl.uint8), e.to(tl.int8)
