"""Bitwise comparison and ulp distance.

Exact means bitwise: two tensors are equal when their integer views are equal,
so +0 and -0 differ and NaNs compare by payload.
"""

import numpy as np
import torch

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
             torch.float64: torch.int64, torch.uint8: torch.uint8, torch.int8: torch.int8,
             torch.int32: torch.int32, torch.int64: torch.int64}


def int_view(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in _INT_VIEW:
        raise TypeError(f"no integer view for {t.dtype}")
    return t.contiguous().view(_INT_VIEW[t.dtype])


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Map floats to int64 so that adjacent floats differ by 1 and +0, -0 both map to 0;
    integer tensors (quantized codes) map to themselves, so codes one apart differ by 1."""
    if not t.is_floating_point():
        return t.to(torch.int64)
    bits = int_view(t).to(torch.int64)
    sign_bit = 1 << (torch.finfo(t.dtype).bits - 1)
    return torch.where(bits < 0, -(bits & (sign_bit - 1)), bits)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Number of representable values between ``a`` and ``b`` (same dtype), as int64;
    for integer tensors (quantized codes) the difference of the codes.

    NaN against anything is reported as the largest int64, so it never looks close.
    """
    if a.dtype != b.dtype:
        raise TypeError(f"ulp_distance needs one dtype, got {a.dtype} and {b.dtype}")
    dist = (ordered_bits(a) - ordered_bits(b)).abs()
    return torch.where(torch.isnan(a) | torch.isnan(b), torch.iinfo(torch.int64).max, dist)


def fp32_from_bits(bits) -> torch.Tensor:
    """fp32 tensor with the given uint32 bit patterns."""
    return torch.from_numpy(np.asarray(bits, dtype=np.uint32).view(np.float32).copy())


def bf16_rounding_edges() -> np.ndarray:
    """fp32 bit patterns (uint32, both signs) around every boundary of rounding to bf16:
    the overflow threshold 0x7F7F8000 and the largest bf16, infinity and NaNs, ties (low
    half 0x8000) with even and odd bf16 neighbours, the subnormal range and its top, zero;
    three patterns either side of each."""
    centres = [0x7F7F8000, 0x7F7F0000, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF,
               0x3F808000, 0x3F818000, 0x00008000, 0x00018000, 0x007F8000, 0x007FFFFF, 0x00800000, 0x0]
    positive = np.array(sorted({(c + d) & 0x7FFFFFFF for c in centres for d in range(-3, 4)}), dtype=np.uint32)
    return np.concatenate([positive, positive | np.uint32(0x80000000)])


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    """A bf16 tensor's 16-bit patterns, as uint32 (room to compare with fp32 patterns)."""
    return t.cpu().view(torch.int16).numpy().view(np.uint16).astype(np.uint32)


def first_difference(actual: torch.Tensor, expected: torch.Tensor):
    """Index (tuple) of the first element whose bits differ, or None."""
    differ = int_view(actual) != int_view(expected)
    if not bool(differ.any()):
        return None
    flat = int(torch.nonzero(differ.flatten())[0])
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), actual.shape))


def _describe(t: torch.Tensor, index) -> str:
    value = t[index]
    if not t.is_floating_point():
        return repr(value.item())
    width = torch.finfo(t.dtype).bits // 4
    pattern = int(int_view(value.reshape(1))[0]) & ((1 << (4 * width)) - 1)
    return f"{value.item()!r} (0x{pattern:0{width}x})"


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor") -> None:
    """Raise AssertionError unless ``actual`` and ``expected`` have identical bits.

    The message names the number of differing elements, the first one with both
    values and bit patterns, and the largest ulp distance.
    """
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: dtype {actual.dtype} != {expected.dtype}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    index = first_difference(actual, expected)
    if index is None:
        return
    count = int((int_view(actual) != int_view(expected)).sum())
    ulps = ulp_distance(actual, expected)
    raise AssertionError(
        f"{what}: {count} of {actual.numel()} elements differ bitwise; first at {index}: "
        f"{_describe(actual, index)} vs {_describe(expected, index)}, {int(ulps[index])} ulp apart; "
        f"largest distance {int(ulps.max())} ulp")
