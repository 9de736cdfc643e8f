"""The q8 state format inside kernels: decode a tile's codes, encode a tile's values.
The format itself (levels, blocks, exponents) and its host reference are in
``forge_kernels.q8``; this is the same arithmetic, tile by tile.

No level table is read, and no log2. A level is ``octave[j % P] * 2**-(j // P)``
(P levels per octave, ``forge_kernels.q8``), so a code's level is octave[j % P]'s fp32
bits, picked from constants by selects, with j // P taken off its exponent field; and
the levels bracketing a value follow from the value's own fp32 bits: its exponent says
which octave it lies in, exact integer comparisons of its mantissa with the octave's
mantissas say where inside it, and the same comparisons select the two levels' mantissa
fields, so encoding decodes no level at all. The bracket is exact by construction (the
earlier search estimated it from a rounded log2 and corrected the estimate with four
reads of a 1 KB level table; on an H200 dropping those reads changed the q8 step's time
by about 1 %, 4096 x 4096, 256 tokens, its tuned config: 0.444 against 0.448 ms;
benchmarks/results/tuning/h200-early-loads-q8-bits.log). Building the bracket from the
comparisons instead of decoding its two codes cut the compiled sm_90 epilogue from 452
to 368 instructions per element (benchmarks/sass_count.py, tuned config), and picking
the octave from registers instead of reading it from a table to 348: the q8 epilogue is
bound by instruction issue.
"""

import numpy as np
import triton
import triton.language as tl

from ..q8 import (BLOCK, MAX_EXPONENT, MIN_EXPONENT, RANDOM_BITS, SIGNED_LEVELS, SIGNED_LEVELS_PER_OCTAVE,
                  UNSIGNED_LEVELS, UNSIGNED_LEVELS_PER_OCTAVE, octave)

Q8_BLOCK = tl.constexpr(BLOCK)
Q8_MIN_EXPONENT = tl.constexpr(MIN_EXPONENT)
Q8_MAX_EXPONENT = tl.constexpr(MAX_EXPONENT)
#: 2**MAX_EXPONENT: a block whose largest magnitude reaches it would need a clamped exponent
Q8_LARGEST_EXPONENT_VALUE = tl.constexpr(2.0**MAX_EXPONENT)
Q8_RANDOM_BITS = tl.constexpr(RANDOM_BITS)
Q8_RANDOM_SCALE = tl.constexpr(float(2**RANDOM_BITS))
Q8_SIGNED_PER_OCTAVE = tl.constexpr(SIGNED_LEVELS_PER_OCTAVE)
Q8_UNSIGNED_PER_OCTAVE = tl.constexpr(UNSIGNED_LEVELS_PER_OCTAVE)


@triton.jit
def _power_of_two(e):
    """2**e as fp32 for an int32 tile e in [-126, 127], from its bits."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


def _octave_fields(per_octave: int) -> list:
    """The fp32 bit patterns of octave[r], r = 0 .. per_octave - 1, as int32 constants."""
    return [int(bits) for bits in octave(per_octave).view(np.int32)]


def _reciprocal(per_octave: int) -> tuple:
    """(M, S) with j // per_octave == (j * M) >> S for every level index j in [0, 255]:
    a multiply and a shift instead of a signed division's correction steps."""
    shift = 8
    while True:
        multiplier = -(-(1 << shift) // per_octave)
        if all((j * multiplier) >> shift == j // per_octave for j in range(256)):
            return multiplier, shift
        shift += 1


_SO0, _SO1, _SO2, _SO3, _SO4, _SO5 = (tl.constexpr(bits) for bits in _octave_fields(SIGNED_LEVELS_PER_OCTAVE))
_UO0, _UO1, _UO2, _UO3, _UO4, _UO5, _UO6 = (tl.constexpr(bits) for bits in _octave_fields(UNSIGNED_LEVELS_PER_OCTAVE))
_S_RECIPROCAL, _S_SHIFT = (tl.constexpr(v) for v in _reciprocal(SIGNED_LEVELS_PER_OCTAVE))
_U_RECIPROCAL, _U_SHIFT = (tl.constexpr(v) for v in _reciprocal(UNSIGNED_LEVELS_PER_OCTAVE))


@triton.jit
def _magnitude_bits(j, SIGNED: tl.constexpr):
    """The fp32 bits of level j in [0, 255] of the magnitudes, octave[j % P] * 2**-(j // P):
    octave[j % P]'s bits with j // P taken off the exponent field (every level is a
    normal number: the smallest is 2**(-255/7)). octave[r] is picked by a binary tree of
    selects on r's bits, in registers: a read of the octave from memory is a gather,
    which the compiler routed through shared memory twice (its addresses to the load's
    layout, the values back)."""
    if SIGNED:
        octaves = (j * _S_RECIPROCAL) >> _S_SHIFT
        r = j - octaves * Q8_SIGNED_PER_OCTAVE
        odd = (r & 1) != 0
        below_4 = tl.where((r & 2) != 0, tl.where(odd, _SO3, _SO2), tl.where(odd, _SO1, _SO0))
        bits = tl.where((r & 4) != 0, tl.where(odd, _SO5, _SO4), below_4)
    else:
        octaves = (j * _U_RECIPROCAL) >> _U_SHIFT
        r = j - octaves * Q8_UNSIGNED_PER_OCTAVE
        odd = (r & 1) != 0
        below_4 = tl.where((r & 2) != 0, tl.where(odd, _UO3, _UO2), tl.where(odd, _UO1, _UO0))
        bits = tl.where((r & 4) != 0, tl.where((r & 2) != 0, _UO6, tl.where(odd, _UO5, _UO4)), below_4)
    return bits - (octaves << 23)


@triton.jit
def _level(code, SIGNED: tl.constexpr):
    """The fp32 level of int32 codes in [0, 255]: level j of the magnitudes (j = 0 is 1.0)
    is octave[j % P] * 2**-(j // P), exact (forge_kernels.q8 builds them so); signed code
    i < 128 is -level i, 128 is 0, 128 + j is level 127 - j; unsigned code i >= 1 is
    level 255 - i, 0 is 0."""
    if SIGNED:
        magnitude = _magnitude_bits(tl.where(code >= 128, 255 - code, code), SIGNED).to(tl.float32, bitcast=True)
        value = tl.where(code > 128, magnitude, tl.where(code < 128, -magnitude, 0.0))
    else:
        magnitude = _magnitude_bits(255 - code, SIGNED).to(tl.float32, bitcast=True)
        value = tl.where(code > 0, magnitude, 0.0)
    return value


@triton.jit
def q8_decode(codes_ptr, exp_ptr, idx, eidx, mask, SIGNED: tl.constexpr):
    """fp32 values of the codes at ``idx``, each with its block's exponent at ``eidx``."""
    code = tl.load(codes_ptr + idx, mask=mask, other=0).to(tl.int32)
    e = tl.load(exp_ptr + eidx, mask=mask, other=0).to(tl.int32)
    return _level(code, SIGNED) * _power_of_two(e)


def _rungs(per_octave: int) -> list:
    """The levels of one binade, rung by rung from its lowest octave mantissa up: for the
    mantissa field M_r of 2 * octave[r] (r = P - 1 down to 1), the triple (M_r, packed,
    higher), ``packed`` holding the count c = P - r of octave mantissas <= M_r from bit 23
    up and M_r below it (one selection for both), ``higher`` the field of the level
    above: M_(r-1), and 2**23 above M_1, which carries into the exponent field (the next
    binade's power of two)."""
    fields = [int(np.float32(2 * value).view(np.uint32)) & 0x7FFFFF for value in octave(per_octave)]
    fields[0] = 1 << 23
    return [(fields[r], (per_octave - r) << 23 | fields[r], fields[r - 1]) for r in range(per_octave - 1, 0, -1)]


def _bits(value) -> int:
    """The fp32 bit pattern of ``value`` as an int32 constant: the same bits on every backend."""
    return int(np.float32(value).view(np.int32))


(_SR1, _SR2, _SR3, _SR4, _SR5), (_SP1, _SP2, _SP3, _SP4, _SP5), (_SH1, _SH2, _SH3, _SH4, _SH5) = (
    tuple(tl.constexpr(v) for v in column) for column in zip(*_rungs(SIGNED_LEVELS_PER_OCTAVE)))
(_UR1, _UR2, _UR3, _UR4, _UR5, _UR6), (_UP1, _UP2, _UP3, _UP4, _UP5, _UP6), (_UH1, _UH2, _UH3, _UH4, _UH5, _UH6) = (
    tuple(tl.constexpr(v) for v in column) for column in zip(*_rungs(UNSIGNED_LEVELS_PER_OCTAVE)))
#: fp32 bits of 1.0, of the smallest positive levels (signed code 129, unsigned code 1)
#: and of the negative level closest to zero (signed code 127).
_ONE = tl.constexpr(_bits(1.0))
_SIGNED_SMALLEST = tl.constexpr(_bits(SIGNED_LEVELS[129]))
_SIGNED_SMALLEST_NEGATIVE = tl.constexpr(_bits(SIGNED_LEVELS[127]))
_UNSIGNED_SMALLEST = tl.constexpr(_bits(UNSIGNED_LEVELS[1]))
_SIGN = tl.constexpr(-(1 << 31))


@triton.jit
def _rung(m, RUNG: tl.constexpr, PACKED: tl.constexpr, HIGHER: tl.constexpr, packed, higher):
    """Climb one rung: where the mantissa field m reaches RUNG, take its pair."""
    reached = m >= RUNG
    return tl.where(reached, PACKED, packed), tl.where(reached, HIGHER, higher)


@triton.jit
def _ladder(x, SIGNED: tl.constexpr):
    """For the bits x of a non-negative fp32 2**E * (1 + m / 2**23): (t, lo, hi), lo the
    bits of the largest level <= x of the unbounded ladder octave[j % P] * 2**-(j // P),
    which is level j = -t, and hi the bits of the next level up. The levels of magnitude
    in [2**E, 2**(E+1)) are 2**E and 2**E * 2 * octave[r] (r = 1 .. P - 1, descending in
    r), so lo is 2**E with the mantissa field of the highest rung m reaches (none: 0),
    and j is -P*E - c, c that rung's count. Each rung's test serves both selections."""
    m = x & 0x7FFFFF
    if SIGNED:
        packed, higher = _rung(m, _SR1, _SP1, _SH1, 0, _SR1)
        packed, higher = _rung(m, _SR2, _SP2, _SH2, packed, higher)
        packed, higher = _rung(m, _SR3, _SP3, _SH3, packed, higher)
        packed, higher = _rung(m, _SR4, _SP4, _SH4, packed, higher)
        packed, higher = _rung(m, _SR5, _SP5, _SH5, packed, higher)
        t = Q8_SIGNED_PER_OCTAVE * ((x >> 23) - 127) + (packed >> 23)
    else:
        packed, higher = _rung(m, _UR1, _UP1, _UH1, 0, _UR1)
        packed, higher = _rung(m, _UR2, _UP2, _UH2, packed, higher)
        packed, higher = _rung(m, _UR3, _UP3, _UH3, packed, higher)
        packed, higher = _rung(m, _UR4, _UP4, _UH4, packed, higher)
        packed, higher = _rung(m, _UR5, _UP5, _UH5, packed, higher)
        packed, higher = _rung(m, _UR6, _UP6, _UH6, packed, higher)
        t = Q8_UNSIGNED_PER_OCTAVE * ((x >> 23) - 127) + (packed >> 23)
    binade = x & 0x7F800000
    return t, binade | (packed & 0x7FFFFF), binade + higher


@triton.jit
def _bracket(u, SIGNED: tl.constexpr):
    """(code, lower, upper): the code of the last of the 256 ascending levels <= u, that
    level and the next one (the same at the top code), for u in [-1, 1], from u's bits
    alone, the same as decoding the code and the next one (kernels/q8.py's levels).
    Positive u: the map's levels are the ladder's (code 255 - j for level j); below the
    map's smallest positive level, u gets the zero code's bracket. Negative u (signed):
    the level <= u closest to it is -(the smallest ladder level >= |u|), which is hi of
    the float just below |u| (its largest level <= it is the largest level < |u|): code
    -t - 1 for that float's t, and the next code's level is -lo; from the smallest level
    (code 127) the next code is zero's. Zero and subnormal u fall below the smallest
    level. A NaN u (its tile is never stored) gets some code."""
    if SIGNED:
        negative = u < 0
        t, lo, hi = _ladder(tl.abs(u).to(tl.int32, bitcast=True) - negative.to(tl.int32), SIGNED)
        positive_code = 255 + t
        in_positive = positive_code >= 129
        negative_code = -1 - t
        in_negative = negative_code < 127
        code = tl.where(negative, tl.minimum(negative_code, 127), tl.where(in_positive, positive_code, 128))
        lower = tl.where(negative, tl.where(in_negative, hi | _SIGN, _SIGNED_SMALLEST_NEGATIVE),
                         tl.where(in_positive, lo, 0))
        upper = tl.where(negative, tl.where(in_negative, lo | _SIGN, 0),
                         tl.where(in_positive, tl.minimum(hi, _ONE), _SIGNED_SMALLEST))
    else:
        t, lo, hi = _ladder(tl.abs(u).to(tl.int32, bitcast=True), SIGNED)
        code = 255 + t
        inside = (u > 0) & (code > 0)
        code = tl.where(inside, code, 0)
        lower = tl.where(inside, lo, 0)
        upper = tl.where(inside, tl.minimum(hi, _ONE), _UNSIGNED_SMALLEST)
    return code, lower.to(tl.float32, bitcast=True), upper.to(tl.float32, bitcast=True)


@triton.jit
def q8_encode(v, word, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SIGNED: tl.constexpr,
              STOCHASTIC: tl.constexpr):
    """(codes uint8 (BLOCK_N, BLOCK_K), exponents int8 (BLOCK_N, BLOCK_K // 32)) of an fp32 tile
    whose lanes outside the matrix hold 0; stochastic codes decide with the top bits of
    each element's random uint32 ``word``."""
    blocks = tl.reshape(tl.abs(v), (BLOCK_N, BLOCK_K // Q8_BLOCK, Q8_BLOCK))
    bits = tl.max(blocks, axis=2).to(tl.uint32, bitcast=True)
    e = ((bits >> 23) & 0xFF).to(tl.int32) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.minimum(tl.maximum(e, Q8_MIN_EXPONENT), Q8_MAX_EXPONENT)
    inverse = tl.broadcast_to(tl.expand_dims(_power_of_two(-e), 2), (BLOCK_N, BLOCK_K // Q8_BLOCK, Q8_BLOCK))
    u = v * tl.reshape(inverse, (BLOCK_N, BLOCK_K))
    code, lower, upper = _bracket(u, SIGNED)
    above = u - lower      # exact, and so is gap - above = upper - u (q8.py)
    gap = upper - lower
    if STOCHASTIC:
        r = (word >> (32 - Q8_RANDOM_BITS)).to(tl.float64)
        up = r * gap.to(tl.float64) < above.to(tl.float64) * Q8_RANDOM_SCALE
    else:
        up = above > gap - above
    return (code + up.to(tl.int32)).to(tl.uint8), e.to(tl.int8)
