"""The q8 state format inside kernels: decode a tile's codes, encode a tile's values.
The format itself (levels, blocks, exponents) and its host reference are in
``forge_kernels.q8``; this is the same arithmetic, tile by tile.

No 256-level table is read, and no log2. A level is ``octave[j % P] * 2**-(j // P)``
(P levels per octave, ``forge_kernels.q8``), so a code's level is one read of a P-entry
octave table (``q8.table``: 64 bytes) times a power of two; and the levels bracketing a
value follow from the value's own fp32 bits: its exponent says which octave it lies in,
exact integer comparisons of its mantissa with the octave's mantissas say where inside
it. The bracket is exact by construction (the earlier search estimated it from a
rounded log2 and corrected the estimate with four reads of a 1 KB level table). On an
H200 this changed the q8 step's time by about 1 % (4096 x 4096, 256 tokens, its tuned
config: 0.444 against 0.448 ms; benchmarks/results/tuning/h200-early-loads-q8-bits.log):
those reads were not what bounds the q8 epilogue.
"""

import numpy as np
import triton
import triton.language as tl

from ..q8 import (BLOCK, MAX_EXPONENT, MIN_EXPONENT, OCTAVE_TABLE_OFFSETS, RANDOM_BITS, SIGNED_LEVELS_PER_OCTAVE,
                  UNSIGNED_LEVELS_PER_OCTAVE, octave)

Q8_BLOCK = tl.constexpr(BLOCK)
Q8_MIN_EXPONENT = tl.constexpr(MIN_EXPONENT)
Q8_MAX_EXPONENT = tl.constexpr(MAX_EXPONENT)
#: 2**MAX_EXPONENT: a block whose largest magnitude reaches it would need a clamped exponent
Q8_LARGEST_EXPONENT_VALUE = tl.constexpr(2.0**MAX_EXPONENT)
Q8_RANDOM_BITS = tl.constexpr(RANDOM_BITS)
Q8_RANDOM_SCALE = tl.constexpr(float(2**RANDOM_BITS))
Q8_SIGNED_PER_OCTAVE = tl.constexpr(SIGNED_LEVELS_PER_OCTAVE)
Q8_UNSIGNED_PER_OCTAVE = tl.constexpr(UNSIGNED_LEVELS_PER_OCTAVE)
Q8_SIGNED_OFFSET = tl.constexpr(OCTAVE_TABLE_OFFSETS[True])
Q8_UNSIGNED_OFFSET = tl.constexpr(OCTAVE_TABLE_OFFSETS[False])


def _mantissas(per_octave: int) -> list:
    """The 23-bit mantissa fields of 2 * octave[r], r = 1 .. per_octave - 1 (descending:
    the levels of one binade above its power of two), padded to six with 2**23, which no
    mantissa field reaches."""
    fields = [int(np.float32(2 * value).view(np.uint32)) & 0x7FFFFF for value in octave(per_octave)[1:]]
    return fields + [1 << 23] * (6 - len(fields))


_S1, _S2, _S3, _S4, _S5, _ = (tl.constexpr(m) for m in _mantissas(SIGNED_LEVELS_PER_OCTAVE))
_U1, _U2, _U3, _U4, _U5, _U6 = (tl.constexpr(m) for m in _mantissas(UNSIGNED_LEVELS_PER_OCTAVE))


@triton.jit
def _power_of_two(e):
    """2**e as fp32 for an int32 tile e in [-126, 127], from its bits."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _level(code, table_ptr, SIGNED: tl.constexpr):
    """The fp32 level of int32 codes in [0, 255]: level j of the magnitudes (j = 0 is 1.0)
    is octave[j % P] * 2**-(j // P), exact (forge_kernels.q8 builds them so); signed code
    i < 128 is -level i, 128 is 0, 128 + j is level 127 - j; unsigned code i >= 1 is
    level 255 - i, 0 is 0."""
    if SIGNED:
        j = tl.where(code >= 128, 255 - code, code)
        octaves = j // Q8_SIGNED_PER_OCTAVE
        magnitude = tl.load(table_ptr + Q8_SIGNED_OFFSET + j - octaves * Q8_SIGNED_PER_OCTAVE) * _power_of_two(-octaves)
        value = tl.where(code > 128, magnitude, tl.where(code < 128, -magnitude, 0.0))
    else:
        j = 255 - code
        octaves = j // Q8_UNSIGNED_PER_OCTAVE
        magnitude = tl.load(table_ptr + Q8_UNSIGNED_OFFSET + j - octaves * Q8_UNSIGNED_PER_OCTAVE) * _power_of_two(-octaves)
        value = tl.where(code > 0, magnitude, 0.0)
    return value


@triton.jit
def q8_decode(codes_ptr, exp_ptr, table_ptr, idx, eidx, mask, SIGNED: tl.constexpr):
    """fp32 values of the codes at ``idx``, each with its block's exponent at ``eidx``."""
    code = tl.load(codes_ptr + idx, mask=mask, other=0).to(tl.int32)
    e = tl.load(exp_ptr + eidx, mask=mask, other=0).to(tl.int32)
    return _level(code, table_ptr, SIGNED) * _power_of_two(e)


@triton.jit
def _lower_code(u, SIGNED: tl.constexpr):
    """The code of the last of the 256 ascending levels <= u, for u in [-1, 1], from u's
    bits: |u| = 2**E * (1 + mantissa / 2**23). The levels of magnitude in [2**E, 2**(E+1))
    are 2**E and 2**E * 2 * octave[r] (r = 1 .. P - 1, descending in r), so the largest
    level <= |u| is level -P*E - c, c the count of octave mantissas <= |u|'s, and the
    smallest level >= |u| is level -P*E - P + d, d the count of octave mantissas >= |u|'s
    (plus one when |u| is the power of two itself). Zero, subnormal and tiny |u| fall
    below the smallest level and get the zero code's bracket; the final clamp keeps a NaN
    u's code (its tile is never stored) in range."""
    bits = tl.abs(u).to(tl.int32, bitcast=True)
    e = (bits >> 23) - 127
    m = bits & 0x7FFFFF
    if SIGNED:
        at_most = ((m >= _S1).to(tl.int32) + (m >= _S2).to(tl.int32) + (m >= _S3).to(tl.int32)
                   + (m >= _S4).to(tl.int32) + (m >= _S5).to(tl.int32))
        at_least = ((m <= _S1).to(tl.int32) + (m <= _S2).to(tl.int32) + (m <= _S3).to(tl.int32)
                    + (m <= _S4).to(tl.int32) + (m <= _S5).to(tl.int32) + (m == 0).to(tl.int32))
        # u > 0: the largest level j <= u is code 255 - j; u < 0: the level -level j <= u
        # closest to it has the largest j with level j >= |u|, code j (at most 127).
        positive = tl.maximum(255 + 6 * e + at_most, 128)
        negative = tl.minimum(-6 * e - 6 + at_least, 127)
        code = tl.where(u > 0, positive, tl.where(u < 0, negative, 128))
    else:
        at_most = ((m >= _U1).to(tl.int32) + (m >= _U2).to(tl.int32) + (m >= _U3).to(tl.int32)
                   + (m >= _U4).to(tl.int32) + (m >= _U5).to(tl.int32) + (m >= _U6).to(tl.int32))
        code = tl.where(u > 0, tl.maximum(255 + 7 * e + at_most, 0), 0)
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
    code = _lower_code(u, SIGNED)
    lower = _level(code, table_ptr, SIGNED)
    upper = _level(tl.minimum(code + 1, 255), table_ptr, SIGNED)
    above = u - lower      # exact, and so is gap - above = upper - u (q8.py)
    gap = upper - lower
    if STOCHASTIC:
        r = (word >> (32 - Q8_RANDOM_BITS)).to(tl.float64)
        up = r * gap.to(tl.float64) < above.to(tl.float64) * Q8_RANDOM_SCALE
    else:
        up = above > gap - above
    return (code + up.to(tl.int32)).to(tl.uint8), e.to(tl.int8)
