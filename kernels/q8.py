"""The 8-bit block-wise optimizer-state format ("q8").

Each state slot is stored as one uint8 code per element plus one int8 power-of-two
exponent per block of ``BLOCK`` = 32 consecutive elements of a row (1.03 bytes per
element: AdamW's two slots take 2.06 bytes per parameter).

Decoding: ``value = levels[code] * 2**exponent``. Encoding: the exponent is
``ceil(log2(absmax))`` of the block (exact integer arithmetic on the fp32 bits), so
the block divided by ``2**exponent`` lies in [-1, 1] exactly (a power-of-two scaling
rounds nothing unless it underflows). The value then lies between two adjacent levels
``a <= u <= b`` and is stored as one of them:

* nearest: ``b`` when ``u - a > b - u``, else ``a`` (ties to the lower code). Both
  differences are exact in fp32 (Sterbenz: adjacent nonzero levels are less than a
  factor 2 apart), so the comparison is exact;
* stochastic: ``b`` with probability ``ceil((u - a) * 2**24 / (b - a)) / 2**24``, from
  24 Philox bits ``r``: round up when ``r * (b - a) < (u - a) * 2**24``, compared in
  fp64, where both products are exact. Unbiased up to ``(b - a) * 2**-24``
  (proofs/stochastic_rounding.md). It keeps a slowly moving second moment moving,
  where nearest rounding stalls it once its per-step change is under half a level.

The levels are logarithmic, so small values keep their relative precision instead of
collapsing to zero (a linear absmax int8 map turns every second moment below 1/255 of
its block's largest into 0, which then divides the update by eps alone), and a whole
number of them per octave, so halving or doubling a level gives a level: when a
block's exponent moves by one, its unchanged values are still exactly representable.

* signed (first moments, momentum): 0, ±2**(-j/6): 6 levels per octave (relative step
  12.2 %), values down to 2**-21 of the block's largest;
* unsigned (second moments, sums of squares): 0, 2**(-j/7): 7 levels per octave
  (relative step 10.4 %), values down to 2**-36 of the block's largest.

Encoding and decoding on the host (``encode``, ``decode``) are the reference the kernel
is compared with, code for code; ``encode`` takes the Philox words as an argument so
that this package needs no random-number reference of its own.
"""

import numpy as np
import torch

BLOCK = 32
SIGNED_LEVELS_PER_OCTAVE = 6
UNSIGNED_LEVELS_PER_OCTAVE = 7
EXPONENT_SUFFIX = "_exponent"
MIN_EXPONENT, MAX_EXPONENT = -126, 126
#: Random bits per stochastic decision (the top 24 of a 32-bit Philox word).
RANDOM_BITS = 24


def octave(per_octave: int) -> np.ndarray:
    """fp32 2**(-r / per_octave) for r = 0 .. per_octave-1: one octave of levels, each
    rounded to fp32 once."""
    return (2.0 ** (-np.arange(per_octave) / per_octave)).astype(np.float32)


def _powers(count: int, per_octave: int) -> np.ndarray:
    """fp32 2**(-j / per_octave) for j = 0 .. count-1, built from one octave of fp32
    roundings scaled by exact powers of two, so that level j + per_octave is level j / 2
    exactly (fp32 rounding commutes with power-of-two scaling of normal numbers)."""
    j = np.arange(count)
    return np.ldexp(octave(per_octave)[j % per_octave], -(j // per_octave)).astype(np.float32)


def _levels(signed: bool) -> np.ndarray:
    if signed:
        values = np.concatenate([-_powers(128, SIGNED_LEVELS_PER_OCTAVE), [0.0],
                                 _powers(127, SIGNED_LEVELS_PER_OCTAVE)[::-1]])
    else:
        values = np.concatenate([[0.0], _powers(255, UNSIGNED_LEVELS_PER_OCTAVE)[::-1]])
    levels = values.astype(np.float32)
    assert levels.size == 256 and np.all(np.diff(levels) > 0)
    return levels


SIGNED_LEVELS = _levels(signed=True)
UNSIGNED_LEVELS = _levels(signed=False)


def exponent_shape(shape) -> tuple:
    rows, cols = shape
    return rows, -(-cols // BLOCK)


def block_exponents(values: np.ndarray) -> np.ndarray:
    """ceil(log2(block absmax)) per block of BLOCK columns, clamped to the format's range."""
    rows, cols = values.shape
    padded = np.zeros((rows, exponent_shape(values.shape)[1] * BLOCK), dtype=np.float32)
    padded[:, :cols] = np.abs(values)
    absmax = padded.reshape(rows, -1, BLOCK).max(axis=2)
    bits = absmax.view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.int32) - 127 + ((bits & 0x7FFFFF) != 0)
    return np.clip(exponent, MIN_EXPONENT, MAX_EXPONENT).astype(np.int8)


def encode(values: torch.Tensor, signed: bool, random_words=None):
    """Host reference of the kernel's encoding: (uint8 codes, int8 exponents).

    Nearest-level codes when ``random_words`` is None; otherwise stochastic codes, element
    ``i`` (row-major) deciding with the 32-bit word ``random_words[i]`` (the kernel uses
    the slot's word of the Philox call at the element's index: word 1 + slot position)."""
    v = values.detach().cpu().float().numpy()
    exponent = block_exponents(v)
    scale = np.repeat(np.ldexp(np.float32(1), -exponent.astype(np.int32)), BLOCK, axis=1)[:, :v.shape[1]]
    u = (v * scale.astype(np.float32)).astype(np.float32)
    levels = SIGNED_LEVELS if signed else UNSIGNED_LEVELS
    lower_code = np.clip(np.searchsorted(levels, u, side="right") - 1, 0, 255)
    lower, upper = levels[lower_code], levels[np.minimum(lower_code + 1, 255)]
    above = u - lower                                           # exact, as in the kernel
    if random_words is None:
        up = above > (upper - lower) - above
    else:
        r = (np.asarray(random_words, dtype=np.uint32).reshape(u.shape) >> np.uint32(32 - RANDOM_BITS))
        up = r.astype(np.float64) * (upper - lower).astype(np.float64) < above.astype(np.float64) * 2.0**RANDOM_BITS
    codes = (lower_code + up).astype(np.uint8)
    return torch.from_numpy(codes), torch.from_numpy(exponent)


def decode(codes: torch.Tensor, exponent: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values of a q8 slot."""
    levels = SIGNED_LEVELS if signed else UNSIGNED_LEVELS
    c = codes.detach().cpu().numpy()
    scale = np.repeat(np.ldexp(np.float32(1), exponent.detach().cpu().numpy().astype(np.int32)), BLOCK,
                      axis=1)[:, :c.shape[1]]
    return torch.from_numpy((levels[c] * scale.astype(np.float32)).astype(np.float32))
