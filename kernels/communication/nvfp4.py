"""NVFP4 on the wire, as Transformer Engine's reference recipe defines it
(``transformer_engine/pytorch/custom_recipes/quantization_nvfp4.py``, 1×16 tiles, no
Hadamard transform, no stochastic rounding).

A tensor of shape (..., K), K a multiple of 16, is cut into blocks of 16 consecutive
elements along the last dimension. With amax the tensor's max |x| (fp32):

* per-tensor encode scale ``S_enc = min(fl(2688 / amax), FLT_MAX)`` (2688 = 448 · 6;
  amax 0 gives FLT_MAX), decode scale ``S_dec = fl(1 / S_enc)``;
* block scale ``s_b = e4m3(clamp(fl(vmax_b · fl(S_enc · fl(1/6))), ≤ 448))`` with vmax_b
  the block's max |x|, stored as its E4M3 byte;
* block encode factor ``e_b = min(fl(1 / fl(fp32(s_b) · S_dec)), FLT_MAX)``;
* value code: ``fl(x · e_b)`` clamped to [-6, 6], rounded to E2M1 {0, 0.5, 1, 1.5, 2, 3,
  4, 6} to nearest with ties to the even code (thresholds 0.25, 0.75, 1.25, 1.75, 2.5,
  3.5, 5; the ties 0.25, 1.25, 2.5, 5 go down, 0.75, 1.75, 3.5 up); sign bit 8 for x < 0
  (also when the magnitude rounds to 0; -0.0 gives code 0). Two codes per byte: element
  2j in the low nibble, 2j+1 in the high one.

Decoding: ``fl(fl(q · fp32(s_b)) · S_dec)``; the inner product is exact (2 by 4
significant bits), so a value rounds once. A straight element-by-element reference
lives in ``forge_verify/numerics/gift_formats.py`` and must agree bit for bit.
"""

from dataclasses import dataclass

import torch

from ..errors import NonFiniteInputError

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
FLT_MAX = torch.finfo(torch.float32).max
#: E2M1 magnitudes by code (the sign is bit 3)
LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@dataclass(frozen=True)
class QuantizedNVFP4:
    """``codes``: uint8 (..., K/2), two E2M1 codes a byte; ``block_scales``: uint8 E4M3 bytes
    (..., K/16); ``amax``: the fp32 per-tensor amax the scales were made from (0-d)."""

    codes: torch.Tensor
    block_scales: torch.Tensor
    amax: torch.Tensor
    fmt: str = "nvfp4"


def _check(x: torch.Tensor) -> None:
    if x.ndim < 1 or x.shape[-1] % BLOCK:
        raise ValueError(f"nvfp4 needs a last dimension that is a multiple of {BLOCK}, got shape {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise NonFiniteInputError("nvfp4: the tensor holds a NaN or an infinity; nothing was encoded")


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    _check(x)
    return x.detach().abs().amax().to(torch.float32) if x.numel() else torch.zeros((), dtype=torch.float32, device=x.device)


def tensor_scales(amax: torch.Tensor):
    """(S_enc, S_dec) in fp32 from the per-tensor amax."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    if not bool(torch.isfinite(amax)) or float(amax) < 0:
        raise NonFiniteInputError(f"nvfp4: amax {float(amax)} is not a finite magnitude")
    s_enc = torch.clamp(torch.tensor(E4M3_MAX * E2M1_MAX, dtype=torch.float32, device=amax.device) / amax,
                        max=FLT_MAX)
    return s_enc, torch.reciprocal(s_enc)


def _e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    magnitude = scaled.abs().clamp(max=E2M1_MAX)
    thresholds = torch.tensor(THRESHOLDS, dtype=torch.float32, device=scaled.device)
    index = torch.searchsorted(thresholds, magnitude.contiguous(), right=False)  # thresholds below
    at_tie = (index < len(THRESHOLDS)) & (thresholds[index.clamp(max=len(THRESHOLDS) - 1)] == magnitude)
    index = index + (at_tie & (index % 2 == 1)).to(index.dtype)  # a tie goes to the even code
    # TE's cast_to_fp4x2 sets the sign for x < 0 only: a negative value that rounds to 0
    # keeps it (code 8), -0.0 itself does not (its (x >= 0) & (x <= 0.25) holds: code 0).
    return (index + 8 * (scaled < 0).to(index.dtype)).to(torch.uint8)


def quantize(x: torch.Tensor, amax: torch.Tensor | None = None) -> QuantizedNVFP4:
    """Codes and block scales of ``x``; ``amax`` defaults to the tensor's own (a shared one
    makes S_enc equal on every rank)."""
    _check(x)
    if amax is None:
        amax = tensor_amax(x)
    amax = torch.as_tensor(amax, dtype=torch.float32, device=x.device)
    s_enc, s_dec = tensor_scales(amax)
    blocks = x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    vmax = blocks.abs().amax(dim=-1, keepdim=True)
    multiplier = s_enc * torch.reciprocal(torch.tensor(E2M1_MAX, dtype=torch.float32, device=x.device))
    block_scale = torch.clamp(vmax * multiplier, max=E4M3_MAX).to(torch.float8_e4m3fn)
    encode_factor = torch.clamp(torch.reciprocal(block_scale.to(torch.float32) * s_dec), max=FLT_MAX)
    codes = _e2m1_codes(blocks * encode_factor).reshape(x.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return QuantizedNVFP4(packed, block_scale.view(torch.uint8).squeeze(-1), amax)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """One E2M1 code (0..15) per element from two-a-byte storage."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    levels = torch.tensor(LEVELS, dtype=torch.float32, device=codes.device)
    magnitude = levels[(codes & 7).long()]
    return torch.where(codes >= 8, -magnitude, magnitude)


def block_products(q: QuantizedNVFP4) -> torch.Tensor:
    """``q · fp32(s_b)`` per element, exact, shape (..., K/16, 16)."""
    values = e2m1_values(unpack(q.codes))
    values = values.reshape(*values.shape[:-1], values.shape[-1] // BLOCK, BLOCK)
    return values * q.block_scales.view(torch.float8_e4m3fn).to(torch.float32).unsqueeze(-1)


def dequantize(q: QuantizedNVFP4) -> torch.Tensor:
    _, s_dec = tensor_scales(q.amax)
    products = block_products(q)
    return (products * s_dec).reshape(*products.shape[:-2], products.shape[-2] * BLOCK)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    return dequantize(quantize(x))
