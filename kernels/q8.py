"""The 8-bit block-wise optimizer-state format ("q8").

Each state slot is stored as one uint8 code per element plus one int8 power-of-two
exponent per block of ``BLOCK`` = 32 consecutive elements of a row (1.03 bytes per
element: AdamW's two slots take 2.06 bytes per parameter).

Decoding: ``value = levels[code] * 2**exponent``. Encoding: the exponent is
``ceil(log2(absmax))`` of the block (exact integer arithmetic on the fp32 bits), so
the block divided by ``2**exponent`` lies in [-1, 1] exactly (a power-of-two scaling
rounds nothing unless it underflows); the code is that of the nearest level (ties to
the lower code), found by comparing with the fp32 midpoints between levels.

The levels are logarithmic, so small values keep their relative precision instead of
collapsing to zero (a linear absmax int8 map turns every second moment below 1/255 of
its block's largest into 0, which then divides the update by eps alone):

* signed (first moments, momentum): 0, ±2**(-24 j / 127): relative step 14 %, values
  down to 2**-24 of the block's largest;
* unsigned (second moments, sums of squares): 0, 2**(-40 j / 254): relative step 11.5 %,
  values down to 2**-40 of the block's largest.

Encoding and decoding on the host (``encode``, ``decode``) are the reference the kernel
is compared with, code for code.
"""

import numpy as np
import torch

BLOCK = 32
SIGNED_RANGE_BITS = 24
UNSIGNED_RANGE_BITS = 40
EXPONENT_SUFFIX = "_exponent"
MIN_EXPONENT, MAX_EXPONENT = -126, 126


def _levels(signed: bool) -> np.ndarray:
    if signed:
        positive = 2.0 ** (-SIGNED_RANGE_BITS * np.arange(126, -1, -1) / 126)          # 127 levels up to 1
        negative = -(2.0 ** (-SIGNED_RANGE_BITS * np.arange(0, 128) / 127))           # 128 levels down from -1
        values = np.concatenate([negative, [0.0], positive])
    else:
        values = np.concatenate([[0.0], 2.0 ** (-UNSIGNED_RANGE_BITS * np.arange(254, -1, -1) / 254)])
    levels = values.astype(np.float32)
    assert levels.size == 256 and np.all(np.diff(levels) > 0)
    return levels


def _midpoints(levels: np.ndarray) -> np.ndarray:
    # Padded with +inf so that a binary search over 256 entries never passes the last level.
    mids = ((levels[:-1].astype(np.float64) + levels[1:]) / 2).astype(np.float32)
    return np.concatenate([mids, [np.inf]]).astype(np.float32)


SIGNED_LEVELS = _levels(signed=True)
UNSIGNED_LEVELS = _levels(signed=False)
#: (4, 256) fp32: signed levels, signed midpoints, unsigned levels, unsigned midpoints
TABLE = np.stack([SIGNED_LEVELS, _midpoints(SIGNED_LEVELS), UNSIGNED_LEVELS, _midpoints(UNSIGNED_LEVELS)])


def table(device) -> torch.Tensor:
    return torch.from_numpy(TABLE.copy()).to(device)


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


def encode(values: torch.Tensor, signed: bool):
    """Host reference of the kernel's encoding: (uint8 codes, int8 exponents)."""
    v = values.detach().cpu().float().numpy()
    exponent = block_exponents(v)
    scale = np.repeat(np.ldexp(np.float32(1), -exponent.astype(np.int32)), BLOCK, axis=1)[:, :v.shape[1]]
    normalized = (v * scale.astype(np.float32)).astype(np.float32)
    mids = TABLE[1] if signed else TABLE[3]
    codes = np.searchsorted(mids, normalized, side="left").astype(np.uint8)
    return torch.from_numpy(codes), torch.from_numpy(exponent)


def decode(codes: torch.Tensor, exponent: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values of a q8 slot."""
    levels = SIGNED_LEVELS if signed else UNSIGNED_LEVELS
    c = codes.detach().cpu().numpy()
    scale = np.repeat(np.ldexp(np.float32(1), exponent.detach().cpu().numpy().astype(np.int32)), BLOCK,
                      axis=1)[:, :c.shape[1]]
    return torch.from_numpy((levels[c] * scale.astype(np.float32)).astype(np.float32))
