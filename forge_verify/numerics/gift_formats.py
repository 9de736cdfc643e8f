"""Straight references of GIFT's wire formats (``forge_kernels.gift``), written
independently of torch's float8 casts, for bit-for-bit comparison.

* ``decode_fp8_bits(code, fmt)``: an FP8 byte decoded from its fields (sign, exponent,
  mantissa) by the IEEE-style formula, NaN and inf by the format's rules.
* ``round_to_grid(v, fmt)``: a float64 value rounded to the nearest finite FP8 value,
  ties to the code with an even mantissa, E4M3 saturating at 448, E5M2 overflowing to
  inf from 61440 (the midpoint above 57344), the sign kept on zero.
* ``fp8_scale_reference``, ``fp8_encode_reference``: current scaling, element by element
  in numpy fp32.
* ``nvfp4_quantize_reference``: TE's NVFP4 recipe block by block in numpy fp32
  scalars, with the E4M3 block-scale cast by ``round_to_grid`` and E2M1 by nearest
  level with ties to the even code.
"""

import functools
import math

import numpy as np
import torch

FP8 = {
    # exponent bits, mantissa bits, bias
    "e4m3": (4, 3, 7),
    "e5m2": (5, 2, 15),
}
E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def decode_fp8_bits(code: int, fmt: str) -> float:
    e_bits, m_bits, bias = FP8[fmt]
    sign = -1.0 if code >> 7 else 1.0
    exponent = (code >> m_bits) & ((1 << e_bits) - 1)
    mantissa = code & ((1 << m_bits) - 1)
    top = (1 << e_bits) - 1
    if fmt == "e4m3" and exponent == top and mantissa == (1 << m_bits) - 1:
        return math.nan  # E4M3 "fn": only S.1111.111 is NaN, no infinities
    if fmt == "e5m2" and exponent == top:
        return sign * math.inf if mantissa == 0 else math.nan
    if exponent == 0:
        return sign * mantissa * 2.0 ** (1 - bias - m_bits)
    return sign * (1 + mantissa / (1 << m_bits)) * 2.0 ** (exponent - bias)


def fp8_table(fmt: str) -> np.ndarray:
    """float64 value of each of the 256 codes."""
    return np.array([decode_fp8_bits(c, fmt) for c in range(256)])


@functools.lru_cache(maxsize=None)
def _finite_positive_codes(fmt):
    table = fp8_table(fmt)
    codes = [c for c in range(128) if math.isfinite(table[c])]
    return np.array(codes), table[codes]


def round_to_grid(v: float, fmt: str) -> int:
    """The FP8 code of float64 ``v``: nearest, ties to even mantissa."""
    if math.isnan(v):
        raise ValueError("NaN has no rounding")
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    codes, values = _finite_positive_codes(fmt)
    top = values[-1]
    if fmt == "e5m2" and a >= 61440.0:
        return sign | 0x7C
    if a >= top:
        return sign | int(codes[-1])
    i = int(np.searchsorted(values, a, side="right")) - 1  # values[i] <= a < values[i+1]
    low, high = values[i], values[i + 1]
    if a - low < high - a:
        pick = i
    elif a - low > high - a:
        pick = i + 1
    else:
        pick = i if codes[i] % 2 == 0 else i + 1
    return sign | int(codes[pick])


def fp8_encode_reference(x: torch.Tensor, scale: float, fmt: str) -> torch.Tensor:
    """uint8 codes: ``round_to_grid(fl32(x * scale))`` per element."""
    flat = x.detach().to(torch.float32).reshape(-1).numpy()
    s = np.float32(scale)
    codes = [round_to_grid(float(np.float32(v) * s), fmt) for v in flat]
    return torch.tensor(codes, dtype=torch.uint8).reshape(x.shape)


def fp8_scale_reference(amax: float, fmt: str) -> float:
    """Current scaling's ``min(fl32(max / amax), FLT_MAX)``, 1 for amax 0 (the clamp is
    Transformer Engine's: below amax = max / FLT_MAX the quotient overflows)."""
    top = np.float32(448.0 if fmt == "e4m3" else 57344.0)
    with np.errstate(over="ignore"):
        return 1.0 if amax == 0 else float(min(top / np.float32(amax), np.finfo(np.float32).max))


def _e2m1_code(v: np.float32) -> int:
    sign = 8 if v < 0 else 0  # TE's rule: -0.0 is code 0, a negative value rounding to 0 is 8
    a = min(abs(float(v)), 6.0)
    distances = [abs(a - level) for level in E2M1_LEVELS]  # exact in float64
    best = min(distances)
    candidates = [i for i, d in enumerate(distances) if d == best]
    return sign | (candidates[0] if len(candidates) == 1 else next(i for i in candidates if i % 2 == 0))


def nvfp4_quantize_reference(x: torch.Tensor):
    """(packed codes, block-scale bytes, amax) of TE's NVFP4 recipe, block by block."""
    f32 = np.float32
    flt_max = f32(np.finfo(np.float32).max)
    rows = x.detach().to(torch.float32).reshape(-1, x.shape[-1]).numpy()
    amax = f32(np.abs(rows).max()) if rows.size else f32(0)
    with np.errstate(divide="ignore", over="ignore"):
        s_enc = min(f32(2688.0) / amax, flt_max)
        s_dec = f32(1.0) / s_enc
        multiplier = s_enc * (f32(1.0) / f32(6.0))
        codes = np.zeros(rows.shape, dtype=np.uint8)
        scales = np.zeros((rows.shape[0], rows.shape[1] // 16), dtype=np.uint8)
        for r in range(rows.shape[0]):
            for b in range(rows.shape[1] // 16):
                block = rows[r, 16 * b:16 * (b + 1)]
                vmax = f32(np.abs(block).max())
                scale_code = round_to_grid(float(min(min(vmax * multiplier, flt_max), f32(448.0))), "e4m3")
                scales[r, b] = scale_code
                block_scale = f32(decode_fp8_bits(scale_code, "e4m3"))
                encode = min(f32(1.0) / (block_scale * s_dec), flt_max)
                for j, v in enumerate(block):
                    codes[r, 16 * b + j] = _e2m1_code(f32(v) * encode)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    shape = x.shape
    return (torch.from_numpy(packed).reshape(*shape[:-1], shape[-1] // 2),
            torch.from_numpy(scales).reshape(*shape[:-1], shape[-1] // 16), float(amax))


def nvfp4_dequantize_reference(packed: torch.Tensor, scales: torch.Tensor, amax: float) -> torch.Tensor:
    f32 = np.float32
    with np.errstate(divide="ignore", over="ignore"):
        s_dec = f32(1.0) / min(f32(2688.0) / f32(amax), f32(np.finfo(np.float32).max))
    p = packed.reshape(-1, packed.shape[-1]).numpy()
    s = scales.reshape(-1, scales.shape[-1]).numpy()
    out = np.zeros((p.shape[0], p.shape[1] * 2), dtype=np.float32)
    for r in range(p.shape[0]):
        for k in range(out.shape[1]):
            code = (int(p[r, k // 2]) >> (4 * (k % 2))) & 0xF
            value = E2M1_LEVELS[code & 7] * (-1.0 if code & 8 else 1.0)
            out[r, k] = f32(f32(value) * f32(decode_fp8_bits(int(s[r, k // 16]), "e4m3"))) * s_dec
    return torch.from_numpy(out).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
